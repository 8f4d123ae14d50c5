"""A memory tier: a cache of expert blocks in fixed-size slots of one arena, LRU or LFU.

Used twice: the host-RAM tier (page-aligned, pinned when CUDA; filled by reader threads) and the
VRAM slot bank (filled by H2D copies; under the device-table schedules its arena's slots are storage/vram_tier.py's,
chosen from GPU use counts rather than by this policy). Threading: all bookkeeping runs on the engine's event-loop
thread; reader threads only fill slot memory and the loop learns of completion through an
asyncio future. No locks.

Invariants:
- An entry being loaded (`ready` not done) or pinned (`pins > 0`) is never evicted.
- Each entry remembers `busy`, the CUDA event after the last GPU work that reads its slot. When
  the slot is handed to a new block, the new entry carries it as `reuse_after`: whoever fills
  the slot must wait for it first (the host: event.synchronize() before a disk read; a copy
  stream: wait_event before an H2D copy), so a slot is never overwritten while being read.
- `lookup` changes LRU order (it counts as a use); `peek` does not.
- Eviction takes the least recently used evictable entry (`lru`), or (`lfu`) the one routed least
  often since the engine opened, ties to the least recently used: the simulator's `lfu`
  (storage/simulate.py), found through a heap with stale items skipped rather than a scan.
- `hold` keeps an entry for good (a hot set loaded at start): it leaves the eviction order, is never
  evicted, and survives `clear` (error recovery), its slot loaded and read only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

import torch


Key = tuple[int, int]  # (model layer, expert)


@dataclass(eq=False)
class CacheEntry:
    key: Key
    slot: int
    buf: torch.Tensor  # uint8 [block_bytes] host memory of the slot
    ready: asyncio.Future | None = None  # pending while a reader fills the slot; None once loaded
    pins: int = 0
    prefetched: bool = False  # loaded (RAM) or copied (VRAM) on a guess and not yet used by a demand
    filled: Any = None  # CUDA event after the copy that filled the slot (VRAM tier), or None
    busy: Any = None  # CUDA event after the last GPU work reading this slot, or None
    reuse_after: Any = None  # the previous occupant's `busy`: wait for it before filling the slot
    job: Any = None  # the reader's Future of the read filling the slot (to promote or cancel a queued guess)

    @property
    def loading(self) -> bool:
        return self.ready is not None and not self.ready.done()


@dataclass
class CacheStats:
    hits: int = 0  # lookups that found the block (loaded or loading)
    misses: int = 0
    evictions: int = 0


POLICIES = ("lru", "lfu")


class BlockCache:
    """`arena.n` slots under `policy` (lru | lfu); `arena.slot(i)` is slot i's memory (uint8 [block_bytes])."""

    def __init__(self, arena: Any, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.arena = arena
        self.capacity = arena.n
        self.policy = policy
        self._entries: OrderedDict[Key, CacheEntry] = OrderedDict()  # LRU first
        self._held: dict[Key, CacheEntry] = {}  # kept for good, outside the eviction order
        self._free = list(range(arena.n - 1, -1, -1))
        self._free_after: dict[int, Any] = {}  # a free slot -> the event to wait for before filling it (`discard`)
        self._released = asyncio.Event()
        self.stats = CacheStats()
        # lfu: uses per key since the engine opened, and a heap of (uses, last use, key), stale items skipped
        self._uses: dict[Key, int] = defaultdict(int)
        self._last: dict[Key, int] = {}
        self._heap: list[tuple[int, int, Key]] = []
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._entries) + len(self._held)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries or key in self._held

    def peek(self, key: Key) -> CacheEntry | None:
        return self._entries.get(key) or self._held.get(key)

    def lookup(self, key: Key) -> CacheEntry | None:
        """The entry for key (loaded or loading), marked most recently used; None if absent."""
        entry = self._entries.get(key)
        if entry is None and key in self._held:
            self.stats.hits += 1
            return self._held[key]
        if entry is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self._entries.move_to_end(key)
            self._used(key)
        return entry

    def try_reserve(self, key: Key, use: bool = True) -> CacheEntry | None:
        """A new pinned, empty entry for key in a free or evicted slot; None if every slot is busy.
        `use=False` (a guess, not a demand): the entry does not count as used for `lfu`."""
        assert key not in self, key
        if self._free:
            slot = self._free.pop()
            reuse_after = self._free_after.pop(slot, None)
        else:
            evicted = self._evict_one()
            if evicted is None:
                return None
            slot, reuse_after = evicted.slot, evicted.busy
        entry = CacheEntry(key, slot, self.arena.slot(slot), pins=1, reuse_after=reuse_after)
        self._entries[key] = entry
        self._used(key, count=use)  # a guess enters lfu's order with no use: first to go if it was wrong
        return entry

    async def reserve(self, key: Key) -> CacheEntry:
        """Like try_reserve, waiting for a pinned entry to be released if none is evictable."""
        while (entry := self.try_reserve(key)) is None:
            self._released.clear()
            await self._released.wait()
        return entry

    def pin(self, entry: CacheEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: CacheEntry, busy: Any = None) -> None:
        """Release one pin; `busy` is the event after GPU work still reading the slot, if any."""
        assert entry.pins > 0, entry.key
        entry.pins -= 1
        if busy is not None:
            entry.busy = busy
        if entry.pins == 0:
            self._released.set()

    def discard(self, entry: CacheEntry) -> None:
        """Drop an entry whose load failed or was cancelled; its slot becomes free. GPU work of the slot's previous
        block may still read it (the entry's `reuse_after`, which a load that never ran did not wait for): the next
        entry in the slot waits for it."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._free.append(entry.slot)
            after = entry.busy if entry.busy is not None else entry.reuse_after
            if after is not None:
                self._free_after[entry.slot] = after
            self._released.set()

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values()) + list(self._held.values())

    def clear(self) -> None:
        """Forget every block and pin but the held ones. Only when no read is in flight and the GPU is idle
        (error recovery)."""
        assert not any(e.loading for e in self._entries.values())
        self._entries.clear()
        for e in self._held.values():
            e.pins = 1
        held = {e.slot for e in self._held.values()}
        self._free = [i for i in range(self.arena.n - 1, -1, -1) if i not in held]
        self._free_after.clear()  # the GPU is idle (see above)
        self._released.set()

    def hold(self, entry: CacheEntry) -> None:
        """Keep a loaded entry for good: one pin that is never released, out of the eviction order."""
        assert self._entries.get(entry.key) is entry and not entry.loading, entry.key
        entry.pins += 1
        self._held[entry.key] = self._entries.pop(entry.key)

    def _used(self, key: Key, count: bool = True) -> None:
        if self.policy == "lfu":
            self._uses[key] += count
            self._last[key] = t = next(self._clock)
            heapq.heappush(self._heap, (self._uses[key], t, key))
            if len(self._heap) > 8 * self.capacity + 64:  # drop stale items now and then
                self._heap = [(self._uses[k], self._last[k], k) for k in self._entries]
                heapq.heapify(self._heap)

    def _evict_one(self) -> CacheEntry | None:
        if self.policy == "lfu":
            return self._evict_least_used()
        for key, entry in self._entries.items():
            if entry.pins == 0 and not entry.loading:
                return self._evict(key)
        return None

    def _evict_least_used(self) -> CacheEntry | None:
        busy, victim = [], None
        while self._heap:
            item = heapq.heappop(self._heap)
            uses, t, key = item
            entry = self._entries.get(key)
            if entry is None or uses != self._uses[key] or t != self._last[key]:
                continue  # stale: the key was used again, or is not cached
            if entry.pins == 0 and not entry.loading:
                victim = self._evict(key)
                break
            busy.append(item)
        for item in busy:
            heapq.heappush(self._heap, item)
        return victim

    def _evict(self, key: Key) -> CacheEntry:
        entry = self._entries.pop(key)
        self.stats.evictions += 1
        return entry
