"""Conversation snapshots: sequence states after each reply, keyed by their tokens, LRU under a byte budget.

A request whose prompt extends a snapshot's tokens restores that state and processes only the new
tail. Only the worker thread touches this store.
"""

from __future__ import annotations

from collections import OrderedDict

from sluice.pipeline.snapshot import Snapshot


class SnapshotStore:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._snaps: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def put(self, snap: Snapshot) -> None:
        if snap.nbytes > self.budget:
            return
        old = self._snaps.pop(snap.tokens, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._snaps[snap.tokens] = snap
        self.bytes += snap.nbytes
        while self.bytes > self.budget:
            _, evicted = self._snaps.popitem(last=False)
            self.bytes -= evicted.nbytes

    def longest_prefix(self, tokens: list[int]) -> Snapshot | None:
        """The snapshot with the most tokens that are a proper prefix of `tokens` (marked recently used)."""
        best = None
        for key, snap in self._snaps.items():
            n = len(key)
            if n < len(tokens) and (best is None or n > len(best.tokens)) and tuple(tokens[:n]) == key:
                best = snap
        if best is None:
            self.misses += 1
        else:
            self.hits += 1
            self._snaps.move_to_end(best.tokens)
        return best
