"""Conversation snapshots: sequence states after each reply, keyed by their tokens, LRU under a byte budget.

A request whose prompt extends a snapshot's tokens restores that state and processes only the new
tail. With images the key is the token list with each image token replaced by a number of its own
(ImageTokens.key), so two prompts alike but for their images never share a state. Only the worker
thread touches this store.
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

    def put(self, snap: Snapshot, key: tuple[int, ...] | None = None) -> None:
        """Keep snap under key (default: its tokens)."""
        if snap.nbytes > self.budget:
            return
        key = snap.tokens if key is None else tuple(key)
        old = self._snaps.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._snaps[key] = snap
        self.bytes += snap.nbytes
        while self.bytes > self.budget:
            _, evicted = self._snaps.popitem(last=False)
            self.bytes -= evicted.nbytes

    def longest_prefix(self, tokens: list[int]) -> Snapshot | None:
        """The snapshot whose key is the longest proper prefix of `tokens` (a key; marked recently used)."""
        best = None
        for key in self._snaps:
            n = len(key)
            if n < len(tokens) and (best is None or n > len(best)) and tuple(tokens[:n]) == key:
                best = key
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._snaps.move_to_end(best)
        return self._snaps[best]
