"""Whole-block reads from the expert store: O_DIRECT into page-aligned host buffers, by a thread pool.

One block = one pread of `block_bytes` at `expert * block_bytes` (both multiples of 4096), into a
page-aligned buffer, so O_DIRECT reads go from the drive straight to (pinned) RAM without the
page cache. Where the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the reader
falls back to buffered reads for that file and logs one warning. Checksums (xxh64 over the
block) are verified after each read unless switched off.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from sluice.errors import CorruptBlockError, StoreError
from sluice.log import get_logger
from sluice.storage.store import PAGE, ExpertStore

log = get_logger()


class HostArena:
    """`n` page-aligned buffers of `nbytes` each in one allocation; pinned (page-locked) if asked.

    Owns its memory; slot tensors are views and stay valid as long as the arena lives.
    """

    def __init__(self, n: int, nbytes: int, pin: bool):
        if nbytes % PAGE:
            raise ValueError(f"slot size {nbytes} is not a multiple of {PAGE}")
        self.n, self.nbytes, self.pinned = n, nbytes, pin
        total = n * nbytes
        if pin:
            raw = torch.empty(total + PAGE, dtype=torch.uint8, pin_memory=True)
            skip = (-raw.data_ptr()) % PAGE
            self._keep = raw
            self.data = raw[skip : skip + total]
        else:
            self._keep = mmap.mmap(-1, max(total, PAGE))  # anonymous mappings are page-aligned
            self.data = torch.frombuffer(self._keep, dtype=torch.uint8)[:total]
        assert self.data.data_ptr() % PAGE == 0

    def slot(self, i: int) -> torch.Tensor:
        return self.data[i * self.nbytes : (i + 1) * self.nbytes]


class BlockReader:
    """Reads blocks into caller-owned page-aligned buffers. Thread-safe; `submit` returns a Future.

    The caller must keep the destination buffer alive and unread until the future completes.
    """

    def __init__(self, store: ExpertStore, threads: int = 8, direct: bool = True, verify: bool = True):
        self.store = store
        self.verify = verify
        self.direct = direct
        self._fds: dict[int, int] = {}
        self._direct: set[int] = set()  # fds opened with O_DIRECT
        self._warned = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sluice-reader")
        self.bytes_read = 0
        self.reads = 0

    def submit(self, layer: int, expert: int, buf: torch.Tensor, after: Any = None) -> Future:
        """Read in a pool thread; `after` (a CUDA event still reading buf) is waited for first."""
        return self._pool.submit(self._read_after, layer, expert, buf, after)

    def _read_after(self, layer: int, expert: int, buf: torch.Tensor, after: Any) -> int:
        if after is not None:
            after.synchronize()
        return self.read_into(layer, expert, buf)

    def read_into(self, layer: int, expert: int, buf: torch.Tensor) -> int:
        """Read block (layer, expert) into buf (uint8 [block_bytes], page-aligned). Blocking."""
        n = self.store.block_bytes
        view = memoryview(buf.numpy())[:n]
        offset = self.store.offset(expert)
        fd = self._fd(layer)
        try:
            got = _pread_full(fd, view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self._is_direct(layer):
                raise StoreError(f"reading layer {layer}, expert {expert} from {self.store.file(layer)}: {e}") from None
            fd = self._fall_back(layer, f"O_DIRECT read failed ({e})")
            got = _pread_full(fd, view, offset)
        if got != n:
            raise CorruptBlockError(layer, expert, f"short read: {got} of {n} bytes from {self.store.file(layer)}")
        if self.verify and xxhash.xxh64(view).intdigest() != self.store.checksum(layer, expert):
            raise CorruptBlockError(layer, expert, f"checksum mismatch in {self.store.file(layer)} at byte {offset}")
        with self._lock:
            self.bytes_read += n
            self.reads += 1
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _fd(self, layer: int) -> int:
        with self._lock:
            fd = self._fds.get(layer)
            if fd is None:
                fd = self._fds[layer] = self._open(self.store.file(layer))
            return fd

    def _open(self, path: Path) -> int:
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self._direct.add(fd)
                return fd
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise StoreError(f"cannot open {path}: {e}") from None
                self._warn(path, f"O_DIRECT refused ({e.strerror})")
        return os.open(path, os.O_RDONLY)

    def _is_direct(self, layer: int) -> bool:
        return self._fds.get(layer) in self._direct

    def _fall_back(self, layer: int, why: str) -> int:
        path = self.store.file(layer)
        with self._lock:
            old = self._fds[layer]
            if old in self._direct:
                self._direct.discard(old)
                self._fds[layer] = os.open(path, os.O_RDONLY)
                os.close(old)
                self._warn(path, why)
            return self._fds[layer]

    def _warn(self, path: Path, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("buffered reads instead of O_DIRECT", file=str(path), reason=why)


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got
