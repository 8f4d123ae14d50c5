"""Whole-block reads from the expert store: O_DIRECT into page-aligned host buffers, by a pool of reader threads.

One block = one pread of `block_bytes` at `expert * block_bytes` (both multiples of 4096), into a
page-aligned buffer, so O_DIRECT reads go from the drive straight to (pinned) RAM without the
page cache. Where the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the reader
falls back to buffered reads for that file and logs one warning. Checksums (the store's, xxh3_64 or xxh64, over the
block) are verified after each read unless switched off.

Two queues: demand reads (a layer is waiting for them) and guesses (prefetches). A reader takes a guess only
while no demand read is queued or running, and at most `guesses` of them run at once (fewer than the threads, where
there are two or more), so a demand read never queues behind a guess and shares the drive with at most that many.
A queued guess can be promoted to a demand (the layer it was for routed to it) or cancelled (it did not).
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
    submitted: float = 0.0
    taken: float = 0.0  # by a reader thread


class BlockReader:
    """Reads blocks into caller-owned page-aligned buffers. Thread-safe; `submit` returns a Future.

    The caller must keep the destination buffer alive and unread until the future completes.
    """

    def __init__(self, store: ExpertStore, threads: int = 8, direct: bool = True, verify: bool = True, guesses: int = 2):
        self.store = store
        self.verify = verify
        self.direct = direct
        self.guesses = max(1, min(guesses, threads - 1))  # guesses read at once, at most: a thread stays for demands
        self._fds: dict[int, int] = {}
        self._direct: set[int] = set()  # fds opened with O_DIRECT
        self._warned = False
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._demand: deque[_Job] = deque()
        self._guess: deque[_Job] = deque()
        self._queued: dict[Future, _Job] = {}
        self._running = [0, 0]  # demand reads, guesses in progress
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
        job = _Job(layer, expert, buf, after, guess, Future(), time.perf_counter())
        with self._cond:
            if self._closed:
                raise StoreError(f"{self.store.path}: the block reader is closed")
            (self._guess if guess else self._demand).append(job)
            self._queued[job.future] = job
            self._cond.notify()
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, name=f"sluice-reader-{i}", daemon=True)
                                 for i in range(self.threads)]
                for t in self._threads:
                    t.start()
        return job.future

    def promote(self, future: Future) -> bool:
        """A queued guess is needed now: read it as a demand, ahead of the other guesses. False if it has started."""
        with self._cond:
            job = self._queued.get(future)
            if job is None or not job.guess:
                return False
            self._guess.remove(job)
            job.guess = False
            job.submitted = time.perf_counter()  # queued as a demand from now
            self._demand.append(job)
            self._cond.notify()
            return True

    def cancel(self, future: Future) -> bool:
        """Drop a read that has not started; its future is cancelled. False if it has started (or finished)."""
        with self._cond:
            job = self._queued.pop(future, None)
            if job is None:
                return False
            (self._guess if job.guess else self._demand).remove(job)
        future.cancel()
        return True

    def _take(self) -> _Job | None:
        with self._cond:
            while True:
                if self._demand:
                    job = self._demand.popleft()
                    break
                if self._guess and not self._running[0] and self._running[1] < self.guesses:
                    job = self._guess.popleft()
                    break
                if self._closed:
                    return None
                self._cond.wait()
            del self._queued[job.future]
            self._running[job.guess] += 1
            job.taken = time.perf_counter()
            return job

    def _work(self) -> None:
        while (job := self._take()) is not None:
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(self._read_after(job))
                    except BaseException as e:  # the waiter sees it (a failed read names layer and expert)
                        job.future.set_exception(e)
            finally:
                with self._cond:
                    self._running[job.guess] -= 1
                    self._cond.notify_all()

    def _read_after(self, job: _Job) -> int:
        if job.after is not None:
            job.after.synchronize()
        return self.read_into(job.layer, job.expert, job.buf, job)

    def read_into(self, layer: int, expert: int, buf: torch.Tensor, job: _Job | None = None) -> int:
        """Read block (layer, expert) into buf (uint8 [block_bytes], page-aligned). Blocking. `job`: the reader's
        own (its read is timed, as a demand or a guess)."""
        n = self.store.block_bytes
        view = memoryview(buf.numpy())[:n]
        offset = self.store.offset(expert)
        fd = self._fd(layer)
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
        if got != n:
            raise CorruptBlockError(layer, expert, f"short read: {got} of {n} bytes from {self.store.file(layer)}")
        if self.verify and self.store.digest(view) != self.store.checksum(layer, expert):
            raise CorruptBlockError(layer, expert, f"checksum mismatch in {self.store.file(layer)} at byte {offset}")
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            if job is not None:
                timed = self._timed["guess" if job.guess else "demand"]
                timed[0] += 1
                timed[1] += job.taken - job.submitted
                timed[2] += end - start
        return n

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
        interval (5 ms by default; on the H200 run with 0.05 ms, the reads and stalls did not change)."""
        with self._lock:
            return self._busy()

    def _busy(self) -> float:
        return self._busy_s + (time.perf_counter() - self._busy_since if self._on_drive else 0.0)

    def counts(self) -> dict[str, float]:
        """The drive's busy time (`busy_s`) and, for the reads this pool's threads finished, by kind (demand: a layer
        waited for it, a guess promoted before it started included, queued from its promotion; guess): how many,
        their time queued (submitted to taken by a thread) and on the drive (the pread alone; an upper bound as
        `busy_s` is), summed."""
        with self._lock:
            d = {"disk_busy_s": self._busy()}
            for kind, (n, queued, drive) in self._timed.items():
                d.update({f"{kind}_reads_timed": n, f"{kind}_queued_s": queued, f"{kind}_drive_s": drive})
            return d

    def close(self) -> None:
        """Cancel the reads not started, wait for the rest, close the files."""
        with self._cond:
            self._closed = True
            dropped = list(self._queued)
            self._queued.clear()
            self._demand.clear()
            self._guess.clear()
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
