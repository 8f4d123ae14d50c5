"""Conversation snapshots on disk (`--snapshot-dir`): the RAM store's spill tier, kept across restarts.

Snapshots the RAM store pushes out of `--snapshot-ram` are written here, and when the server stops so is
every snapshot still in RAM. Before the worker takes a request, a snapshot on disk that extends further into
its prompt than any in RAM is read back into RAM. File I/O runs on the event loop through aiofiles and
(de)serialising in a worker thread (anyio.to_thread), so the engine's thread never waits for the disk.

Files live in <dir>/<model identity>/ (api/snapshot_file.py model_identity: other models' snapshots are
never read or touched), one <xxh3 of the key>.snap each, written to a .tmp name and renamed. The folder is
capped at `--snapshot-disk` bytes, least recently used files removed first. A file that fails a check (its
header at start, its length and checksum at load) is removed with a log line and never used.

Invariants: the index (key -> file) is touched only on the event loop; `spill` is the one call made from
the worker thread, and it only schedules work on the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import aiofiles.os
import anyio
import xxhash
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sluice.api.snapshot_file import PREFIX, SnapshotFileError, decode, encode, header_length, parse_header
from sluice.api.snapshots import SnapshotStore
from sluice.errors import ConfigError
from sluice.pipeline.snapshot import Snapshot

QUEUE = 4  # snapshots waiting to be written, each held in RAM until then; beyond it a spill is skipped


@dataclass(frozen=True)
class Entry:
    path: Path
    nbytes: int  # the file's size


class DiskSnapshots:
    def __init__(self, folder: Path, cap_bytes: int, identity: str, allowed: tuple[type, ...], log):
        self.folder = Path(folder) / identity
        try:  # at startup, so a folder that cannot be one fails before serving
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--snapshot-dir {folder}: {e.strerror or e}") from None
        self.cap, self.identity, self.allowed, self.log = cap_bytes, identity, allowed, log
        self.index: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        send, receive = anyio.create_memory_object_stream(QUEUE)
        self._send: MemoryObjectSendStream = send
        self._receive: MemoryObjectReceiveStream = receive
        self._drained = anyio.Event()  # run() has written everything queued

    async def open(self) -> None:
        """Index the folder's snapshots (headers only), oldest first; drop what fails its header; apply the cap."""
        self._loop = asyncio.get_running_loop()
        found = []
        for name in await aiofiles.os.listdir(self.folder):
            path = self.folder / name
            if name.endswith(".snap.tmp"):  # a write the last server did not finish
                await aiofiles.os.remove(path)
            elif name.endswith(".snap"):
                try:
                    key, size, mtime = await self._read_key(path)
                except (SnapshotFileError, OSError) as e:
                    await self._drop(path, str(e))
                    continue
                found.append((mtime, key, Entry(path, size)))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._index(key, entry)
        await self._trim()
        self.log.info("snapshots on disk", folder=str(self.folder), snapshots=len(self.index), bytes=self.bytes, cap=self.cap)

    async def _read_key(self, path: Path) -> tuple[tuple[int, ...], int, float]:
        st = await aiofiles.os.stat(path)
        async with aiofiles.open(path, "rb") as f:
            n = header_length(await f.read(PREFIX))
            header = parse_header(await f.read(n), self.identity)
        if header.file_bytes != st.st_size:
            raise SnapshotFileError(f"truncated or padded: {st.st_size} bytes, the header says {header.file_bytes}")
        return header.key, st.st_size, st.st_mtime

    def best(self, tokens: list[int]) -> tuple[int, ...] | None:
        """The longest key on disk that is a proper prefix of tokens."""
        best = None
        for key in self.index:
            if len(key) < len(tokens) and (best is None or len(key) > len(best)) and tuple(tokens[: len(key)]) == key:
                best = key
        return best

    async def lookup(self, tokens: list[int], ram: SnapshotStore) -> Snapshot | None:
        """The snapshot on disk that covers more of tokens than any in RAM, read back; None if there is none."""
        key = self.best(tokens)
        if key is None or len(key) <= ram.prefix_length(tokens):
            return None
        return await self.load(key)

    async def load(self, key: tuple[int, ...]) -> Snapshot | None:
        entry = self.index[key]
        try:
            async with aiofiles.open(entry.path, "rb") as f:
                data = await f.read()
            header, snap = await anyio.to_thread.run_sync(decode, data, self.identity, self.allowed)
            if header.key != key:
                raise SnapshotFileError("its key is not the one its name stands for")
        except (SnapshotFileError, OSError) as e:
            await self._drop(entry.path, str(e), key)
            return None
        if key in self.index:  # (a save meanwhile may have trimmed it)
            self.index.move_to_end(key)
            await anyio.to_thread.run_sync(os.utime, entry.path)  # its age orders the next server's index
        return snap

    async def save(self, key: tuple[int, ...], snap: Snapshot) -> None:
        """Write one snapshot (a key already on disk holds the same state: only marked recently used)."""
        if key in self.index:
            self.index.move_to_end(key)
            return
        data = await anyio.to_thread.run_sync(encode, snap, key, self.identity)
        if len(data) > self.cap:
            return
        path = self.folder / f"{xxhash.xxh3_64_hexdigest(repr(key).encode())}.snap"
        tmp = path.with_name(path.name + ".tmp")
        try:
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(data)
            await aiofiles.os.replace(tmp, path)
        except OSError as e:
            self.log.warning("snapshot not written", file=str(path), error=str(e))
            return
        self._forget_path(path)  # a different key with the same name (a hash collision) is overwritten
        self._index(key, Entry(path, len(data)))
        await self._trim()

    def spill(self, key: tuple[int, ...], snap: Snapshot) -> None:
        """From the worker thread (the RAM store's on_evict): queue the snapshot for writing."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._queue, key, snap)
            except RuntimeError:  # the loop has closed (a worker that outlived the server's stop): nothing to write to
                pass

    def _queue(self, key: tuple[int, ...], snap: Snapshot) -> None:
        try:
            self._send.send_nowait((key, snap))
        except (anyio.WouldBlock, anyio.ClosedResourceError):
            self.log.warning("snapshot not spilled to disk: the writer is behind", tokens=len(key))

    async def run(self) -> None:
        """Write queued snapshots until `close`."""
        try:
            async with self._receive:
                async for key, snap in self._receive:
                    await self.save(key, snap)
        finally:
            self._drained.set()

    async def close(self, ram: SnapshotStore) -> None:
        """Stop queueing, then write what RAM still holds (least recently used first), so a restart finds it."""
        self._send.close()
        await self._drained.wait()  # one writer at a time
        for key, snap in ram.items():
            await self.save(key, snap)

    def _index(self, key: tuple[int, ...], entry: Entry) -> None:
        self.index[key] = entry
        self.bytes += entry.nbytes

    def _forget_path(self, path: Path) -> None:
        for key in [k for k, e in self.index.items() if e.path == path]:
            self.bytes -= self.index.pop(key).nbytes

    async def _trim(self) -> None:
        while self.bytes > self.cap and self.index:
            key, entry = next(iter(self.index.items()))
            self.bytes -= self.index.pop(key).nbytes
            try:
                await aiofiles.os.remove(entry.path)
            except FileNotFoundError:
                pass

    async def _drop(self, path: Path, why: str, key: tuple[int, ...] | None = None) -> None:
        self.log.warning("snapshot file dropped", file=str(path), reason=why)
        entry = self.index.pop(key, None) if key is not None else None
        if entry is not None:
            self.bytes -= entry.nbytes
        try:
            await aiofiles.os.remove(path)
        except FileNotFoundError:
            pass
