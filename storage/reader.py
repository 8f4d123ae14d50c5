"""Whole-block reads from the expert store: O_DIRECT into page-aligned host buffers, by a pool of reader threads.

One block = one pread of `block_bytes` at `expert * block_bytes` (both multiples of 4096), into a
page-aligned buffer, so O_DIRECT reads go from the drive straight to (pinned) RAM without the
page cache. Where the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the reader
falls back to buffered reads for that file and logs one warning. Checksums (the store's, xxh3_64 or xxh64, over the
block) are verified after each read unless switched off.

A block can be read in `pieces` page-aligned parts, each one pread by whichever thread takes it, the next
block's pieces queued behind: a lone block then has the drive's parallel rate, not one read's, and blocks land
in the order they were asked for instead of together (a drive whose rate needs several reads at once;
docs/benchmarks/2026-12-02.md). Its checksum is checked once its last piece lands, and its future completes then.

Two queues: demand reads (a layer is waiting for them) and guesses (prefetches). A reader takes a guess's piece
only while no demand read's piece is queued or running, and at most `guesses` of them run at once (fewer than the
threads, where there are two or more), so a demand read never queues behind a guess and shares the drive with at
most that many pieces. A queued guess can be promoted to a demand (the layer it was for routed to it: its pieces
not started are read as a demand's, behind the demands already queued) or cancelled (it did not; only before its
first piece starts). A future cancelled by its holder before its first piece starts is never read.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


@dataclass(eq=False)
class _Job:
    layer: int
    expert: int
    buf: torch.Tensor
    after: Any
    guess: bool
    future: Future
    pieces: int  # the block's pieces, read by the pool's threads
    submitted: float = 0.0
    taken: float = 0.0  # its first piece, by a reader thread
    kind: str = "demand"  # as its first piece was taken (demand | guess): what `counts` times it as
    next: int = 0  # pieces taken by threads
    left: int = 0  # pieces not landed
    start: float = float("inf")  # the first piece's pread began
    end: float = 0.0  # the last piece's pread ended
    # the failure of the lowest-index piece that failed, and that index: raised once every piece has landed
    error: BaseException | None = None
    error_at: int = 0


class BlockReader:
    """Reads blocks into caller-owned page-aligned buffers. Thread-safe; `submit` returns a Future.

    The caller must keep the destination buffer alive and unread until the future completes.
    """

    def __init__(self, store: ExpertStore, threads: int = 8, direct: bool = True, verify: bool = True, guesses: int = 2,
                 pieces: int = 1):
        if pieces < 1:
            raise ValueError(f"a block is read in at least one piece, got {pieces}")
        self.store = store
        self.pieces = _split(store.block_bytes, pieces)  # (start, bytes) in a block, each a multiple of a page
        self.verify = verify
        self.direct = direct
        # guesses' pieces read at once, at most: a thread stays for demands
        self.guesses = max(1, min(guesses, threads - 1))
        self._fds: dict[int, int] = {}
        self._direct: set[int] = set()  # fds opened with O_DIRECT
        self._warned = False
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._demand: deque[_Job] = deque()
        self._guess: deque[_Job] = deque()
        self._queued: dict[Future, _Job] = {}
        self._running = [0, 0]  # demand pieces, guess pieces on their way (taken by a thread, not landed)
        self._closed = False
        self._threads: list[threading.Thread] = []  # started with the first read
        self.threads = max(1, threads)
        self.bytes_read = 0
        self.reads = 0
        self._on_drive = 0  # reads between their pread's start and end
        self._busy_since = 0.0
        self._busy_s = 0.0  # time with at least one read on the drive (checksums and waits before reads left out)
        self._timed = {"demand": [0, 0.0, 0.0], "guess": [0, 0.0, 0.0]}  # kind -> [reads, queued s, on the drive s]

    def submit(self, layer: int, expert: int, buf: torch.Tensor, after: Any = None, guess: bool = False) -> Future:
        """Read in a reader thread; `after` (a CUDA event still reading buf) is waited for first. A `guess` waits
        while demand reads are queued or running."""
        job = _Job(layer, expert, buf, after, guess, Future(), len(self.pieces), time.perf_counter())
        job.left = job.pieces
        with self._cond:
            if self._closed:
                raise StoreError(f"{self.store.path}: the block reader is closed")
            (self._guess if guess else self._demand).append(job)
            self._queued[job.future] = job
            self._cond.notify(job.pieces)
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, name=f"sluice-reader-{i}", daemon=True)
                                 for i in range(self.threads)]
                for t in self._threads:
                    t.start()
        return job.future

    def promote(self, future: Future) -> bool:
        """A queued guess is needed now: its pieces not started are read as a demand's, ahead of the other guesses.
        True if none had started (it is a demand read from now); False if it had (or it is done)."""
        with self._cond:
            job = self._queued.get(future)
            if job is None or not job.guess:
                return False
            self._guess.remove(job)
            job.guess = False
            self._demand.append(job)
            self._cond.notify_all()
            if job.next:
                return False
            job.submitted = time.perf_counter()  # queued as a demand from now
            return True

    def cancel(self, future: Future) -> bool:
        """Drop a read none of whose pieces has started; its future is cancelled. False if one has (or it is done)."""
        with self._cond:
            job = self._queued.get(future)
            if job is None or job.next:
                return False
            del self._queued[future]
            (self._guess if job.guess else self._demand).remove(job)
        future.cancel()
        return True

    def _take(self) -> tuple[_Job, int, bool] | None:
        """The next piece to read: (its block's job, its index, whether it is a guess's)."""
        with self._cond:
            while True:
                if self._demand:
                    queue = self._demand
                elif self._guess and not self._running[0] and self._running[1] < self.guesses:
                    queue = self._guess
                elif self._closed:
                    return None
                else:
                    self._cond.wait()
                    continue
                job, guess = queue[0], queue is self._guess
                if job.next == 0 and not job.future.set_running_or_notify_cancel():  # its holder cancelled it
                    queue.popleft()
                    del self._queued[job.future]
                    continue
                i = job.next
                job.next += 1
                if i == 0:
                    job.taken, job.kind = time.perf_counter(), "guess" if guess else "demand"
                if job.next == job.pieces:
                    queue.popleft()
                    del self._queued[job.future]
                self._running[guess] += 1
                return job, i, guess

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            job, i, guess = taken
            try:
                self._read_piece(job, i)
            except BaseException as e:  # the waiter sees it once every piece has landed
                with self._cond:
                    if job.error is None or i < job.error_at:
                        job.error, job.error_at = e, i
            finally:
                with self._cond:
                    self._running[guess] -= 1
                    job.left -= 1
                    last = job.left == 0
                    self._cond.notify_all()
            if last:
                self._land(job)

    def _read_piece(self, job: _Job, i: int) -> None:
        if job.after is not None:
            job.after.synchronize()
        at, n = self.pieces[i]
        start, end = self._pread(job.layer, job.expert, memoryview(job.buf.numpy())[at : at + n], at)
        with self._cond:
            job.start, job.end = min(job.start, start), max(job.end, end)

    def _land(self, job: _Job) -> None:
        """A block's last piece has landed: check it, count it, complete its future."""
        try:
            if job.error is not None:
                raise job.error
            n = self.store.block_bytes
            self._verify(job.layer, job.expert, memoryview(job.buf.numpy())[:n])
            self._count(n, job.kind, job.taken - job.submitted, job.end - job.start)
            job.future.set_result(n)
        except BaseException as e:  # the waiter sees it (a failed read names layer and expert)
            job.future.set_exception(e)  # (a running future cannot be cancelled: it is still pending here)

    def read_into(self, layer: int, expert: int, buf: torch.Tensor) -> int:
        """Read block (layer, expert) into buf (uint8 [block_bytes], page-aligned) in one pread, in this thread."""
        n = self.store.block_bytes
        view = memoryview(buf.numpy())[:n]
        self._pread(layer, expert, view, 0)
        self._verify(layer, expert, view)
        self._count(n)
        return n

    def _pread(self, layer: int, expert: int, view: memoryview, at: int) -> tuple[float, float]:
        """pread all of view from the block's byte `at` on: (when the read began, when it ended). A short read (the
        file ends first) raises, with the bytes of the block the file holds."""
        fd, offset = self._fd(layer), self.store.offset(expert) + at
        start = self._drive(+1)
        try:
            got = _pread_full(fd, view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self._is_direct(layer):
                raise StoreError(f"reading layer {layer}, expert {expert} from {self.store.file(layer)}: {e}") from None
            fd = self._fall_back(layer, f"O_DIRECT read failed ({e})")
            got = _pread_full(fd, view, offset)
        finally:
            end = self._drive(-1)
        if got != len(view):
            raise CorruptBlockError(layer, expert, f"short read: {at + got} of {self.store.block_bytes} bytes "
                                                   f"from {self.store.file(layer)}")
        return start, end

    def _verify(self, layer: int, expert: int, view: memoryview) -> None:
        if self.verify and self.store.digest(view) != self.store.checksum(layer, expert):
            raise CorruptBlockError(layer, expert, f"checksum mismatch in {self.store.file(layer)} "
                                                   f"at byte {self.store.offset(expert)}")

    def _count(self, n: int, kind: str | None = None, queued: float = 0.0, drive: float = 0.0) -> None:
        """A block landed: its bytes, and for the pool's own reads (`kind`) its time queued and on the drive."""
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            if kind is not None:
                timed = self._timed[kind]
                timed[0] += 1
                timed[1] += queued
                timed[2] += drive

    def _drive(self, n: int) -> float:
        """A read goes on (+1) or off (-1) the drive; the time now."""
        with self._lock:
            now = time.perf_counter()
            if n > 0 and self._on_drive == 0:
                self._busy_since = now
            self._on_drive += n
            if n < 0 and self._on_drive == 0:
                self._busy_s += now - self._busy_since
            return now

    def busy_s(self) -> float:
        """Seconds so far during which at least one block read was on the drive (from its pread's start to its end):
        how much of a run the drive worked, whatever the number of reads at once. An upper bound: a read's end is
        seen once its thread has the interpreter lock back, which a busy main thread hands over only every switch
        interval (5 ms by default; a shorter one did not change the reads, docs/benchmarks/2026-12-02.md)."""
        with self._lock:
            return self._busy()

    def _busy(self) -> float:
        return self._busy_s + (time.perf_counter() - self._busy_since if self._on_drive else 0.0)

    def counts(self) -> dict[str, float]:
        """The drive's busy time (`busy_s`) and, for the reads this pool's threads finished, by kind (demand: a layer
        waited for it, a guess promoted before it started included, queued from its promotion; guess): how many,
        their time queued (submitted to its first piece taken by a thread) and on the drive (its first piece's pread
        start to its last's end, so with pieces it includes other reads' pieces in between; an upper bound as `busy_s`
        is), summed."""
        with self._lock:
            d = {"disk_busy_s": self._busy()}
            for kind, (n, queued, drive) in self._timed.items():
                d.update({f"{kind}_reads_timed": n, f"{kind}_queued_s": queued, f"{kind}_drive_s": drive})
            return d

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the reads not started, wait for the rest (a block partly read is read to its end), close the files."""
        with self._cond:
            self._closed = True
            dropped = [f for f, job in self._queued.items() if not job.next]  # a block partly read is read to its end
            for f in dropped:
                job = self._queued.pop(f)
                (self._guess if job.guess else self._demand).remove(job)
            self._cond.notify_all()
        for f in dropped:
            f.cancel()
        for t in self._threads:
            t.join()
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


def _split(block_bytes: int, pieces: int) -> tuple[tuple[int, int], ...]:
    """A block as (start, bytes) parts of whole pages, at most `pieces` of them, as even as pages allow."""
    pages = block_bytes // PAGE
    n = max(1, min(pieces, pages))
    cuts = [PAGE * (pages * i // n) for i in range(n + 1)]
    return tuple((a, b - a) for a, b in zip(cuts, cuts[1:]))
