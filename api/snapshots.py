"""Conversation snapshots: sequence states after each reply, keyed by their tokens, LRU under a byte budget.

A request whose prompt extends a snapshot's tokens restores that state and processes only the new
tail. With images the key is the token list with each image token replaced by a number of its own
(ImageTokens.key), so two prompts alike but for their images never share a state. The worker thread
puts and takes snapshots; the server's event loop looks at the keys and puts snapshots it read from
disk (api/snapshot_disk.py), so every call holds a lock. A snapshot pushed out of the budget goes to
`on_evict` (the disk tier), called outside the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from sluice.pipeline.snapshot import Snapshot


class SnapshotStore:
    def __init__(self, budget_bytes: int, on_evict: Callable[[tuple[int, ...], Snapshot], None] | None = None):
        self.budget = budget_bytes
        self.on_evict = on_evict
        self._snaps: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def put(self, snap: Snapshot, key: tuple[int, ...] | None = None) -> None:
        """Keep snap under key (default: its tokens)."""
        key = snap.tokens if key is None else tuple(key)
        evicted = []
        with self._lock:
            if snap.nbytes > self.budget:
                evicted.append((key, snap))
            else:
                old = self._snaps.pop(key, None)
                if old is not None:
                    self.bytes -= old.nbytes
                self._snaps[key] = snap
                self.bytes += snap.nbytes
                while self.bytes > self.budget:
                    out = self._snaps.popitem(last=False)
                    self.bytes -= out[1].nbytes
                    evicted.append(out)
        if self.on_evict is not None:
            for k, s in evicted:
                self.on_evict(k, s)

    def longest_prefix(self, tokens: list[int]) -> Snapshot | None:
        """The snapshot whose key is the longest proper prefix of `tokens` (a key; marked recently used)."""
        with self._lock:
            best = self._best(tokens)
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self._snaps.move_to_end(best)
            return self._snaps[best]

    def prefix_length(self, tokens: list[int]) -> int:
        """The length of the key longest_prefix would take (0: none), counting nothing and moving nothing."""
        with self._lock:
            best = self._best(tokens)
            return 0 if best is None else len(best)

    def items(self) -> list[tuple[tuple[int, ...], Snapshot]]:
        """(key, snapshot) pairs, least recently used first."""
        with self._lock:
            return list(self._snaps.items())

    def _best(self, tokens: list[int]) -> tuple[int, ...] | None:
        best = None
        for key in self._snaps:
            n = len(key)
            if n < len(tokens) and (best is None or n > len(best)) and tuple(tokens[:n]) == key:
                best = key
        return best
