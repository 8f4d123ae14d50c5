"""The block cache (RAM tier and VRAM bank): LRU order, pins, loading entries, waiting, counters."""

from __future__ import annotations

import asyncio

import pytest

from sluice.storage.cache import BlockCache
from sluice.storage.reader import HostArena


def cache(n=3) -> BlockCache:
    return BlockCache(HostArena(n, 4096, pin=False))


def fill(c: BlockCache, key):
    e = c.try_reserve(key)
    c.unpin(e)
    return e


def test_lru_order_and_counters():
    c = cache(3)
    for k in [(0, 0), (0, 1), (0, 2)]:
        fill(c, k)
    assert c.lookup((0, 0)) is not None  # (0,0) becomes most recent
    assert c.lookup((0, 9)) is None
    fill(c, (0, 3))  # evicts the least recently used: (0,1)
    assert (0, 1) not in c and (0, 0) in c and (0, 2) in c
    assert (c.stats.hits, c.stats.misses, c.stats.evictions) == (1, 1, 1)
    assert c.peek((0, 2)) is not None and c.stats.hits == 1  # peek does not count or reorder


def test_pinned_and_loading_entries_are_never_evicted():
    c = cache(2)
    pinned = c.try_reserve((1, 0))  # pinned until unpinned
    loading = c.try_reserve((1, 1))
    loop = asyncio.new_event_loop()
    loading.ready = loop.create_future()
    c.unpin(loading)  # unpinned but still loading
    assert c.try_reserve((1, 2)) is None
    loading.ready.set_result(4096)
    e = c.try_reserve((1, 2))
    assert e.slot == loading.slot and (1, 1) not in c and (1, 0) in c
    c.unpin(pinned)
    loop.close()


def test_reserve_waits_for_a_release():
    async def main():
        c = cache(1)
        held = c.try_reserve((2, 0))
        waiter = asyncio.create_task(c.reserve((2, 1)))
        await asyncio.sleep(0)
        assert not waiter.done()
        c.unpin(held)
        got = await asyncio.wait_for(waiter, 1)
        assert got.key == (2, 1) and (2, 0) not in c

    asyncio.run(main())


def test_slot_reuse_carries_the_previous_readers_event():
    c = cache(1)
    e = c.try_reserve((3, 0))
    c.unpin(e, busy="copy-event")
    again = c.try_reserve((3, 1))
    assert again.slot == e.slot and again.reuse_after == "copy-event"
    # a load that never ran (a cancelled guess) did not wait for that event: its discarded slot still hands it on
    c.discard(again)
    third = c.try_reserve((3, 2))
    assert third.slot == e.slot and third.reuse_after == "copy-event"
    c.discard(third)
    c.clear()  # error recovery: the GPU is idle, nothing left to wait for
    assert c.try_reserve((3, 3)).reuse_after is None


def test_arena_slots_are_page_aligned():
    a = HostArena(5, 8192, pin=False)
    assert all(a.slot(i).data_ptr() % 4096 == 0 for i in range(5))
    with pytest.raises(ValueError):
        HostArena(2, 1000, pin=False)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policies_evict_as_the_simulator_does(policy):
    """On a skewed random stream the engine's tier and the simulator's cache of the same policy hit and miss
    alike, access by access (so `sluice simulate --policy` predicts the engine); LFU keeps the hot keys."""
    import random

    from sluice.storage.simulate import _make

    rng = random.Random(0)
    keys = [(0, min(int(rng.expovariate(0.15)), 40)) for _ in range(3000)]
    sim = _make(policy, 8, {})
    engine_hits = _hits(BlockCache(HostArena(8, 4096, pin=False), policy), keys)
    assert engine_hits == [sim.access(key, i) for i, key in enumerate(keys)]
    if policy == "lfu":
        assert sum(engine_hits) > 1.1 * sum(_hits(cache(8), keys))


def _hits(c: BlockCache, keys) -> list[bool]:
    """Use each key in turn (a miss brings it in); whether each use hit."""
    hits = []
    for key in keys:
        hits.append(c.lookup(key) is not None)
        if not hits[-1]:
            fill(c, key)
    return hits


def test_held_entries_stay_and_bad_policy_is_named():
    c = BlockCache(HostArena(2, 4096, pin=False), "lfu")
    hot = c.try_reserve((0, 1))
    c.hold(hot)
    c.unpin(hot)
    for e in range(2, 40):
        c.unpin(c.try_reserve((0, e)))
    assert (0, 1) in c and c.lookup((0, 1)) is hot
    c.clear()  # error recovery forgets the rest, not the held block, and its slot stays taken
    assert (0, 1) in c and len(c) == 1 and c.try_reserve((0, 2)).slot != hot.slot
    with pytest.raises(ValueError, match="policy must be one of lru, lfu"):
        BlockCache(HostArena(1, 4096, pin=False), "random")
