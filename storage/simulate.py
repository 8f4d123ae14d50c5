"""`sluice simulate`: replay a routing trace through tier caches offline, to size them on paper.

The replay follows the fetch and h2d stages: per MoE layer, each distinct routed expert in ascending
order looks in the VRAM slots (if any), then the RAM cache, else it is read from disk into RAM; then
the blocks that were not in VRAM take VRAM slots, evicting none of the layer's own. After the layer's demand, the guesses recorded for the
next layer are read into RAM ahead (when the trace's schedule prefetched), evicting only blocks
the layer is not still using, and stopping at the first guess with no room, as the engine does. Policies decide what
to evict: lru (the engine's), lfu, fifo, and belady (evict the block used furthest in the future:
the optimum no online policy beats). When the run copied guesses into VRAM (`h2d: {prefetch: true}`,
one-token steps), the guesses already in RAM before the layer's own prefetch reads are put in the VRAM
tier too, as no use (an `lfu` tier evicts them first), stopping at the first with no room.

Checked against live runs (tests/test_plan.py): with the recorded cache size the replay gives the
live disk reads per token. It models pins only at prefetch time, so a cache smaller than one
layer's distinct experts (which the engine passes through in waves) is replayed less exactly. Reads take no time
here: every guess is read, where a live run drops a guess still queued when its layer comes without routing to it
(on a slow drive, with guesses several layers ahead, the replay reads more guesses than the run did).
A run that guessed further ahead (`predict: {depth: N}` or direct's `depth`, the header's `prefetch_depth`) records
the guesses for the layers after the next one too; they are read after the next layer's, nearest layer first, as fetch
does (`depth` replays fewer of them: what the run would have read guessing less far ahead). Traces from before those
were recorded hold the next layer's guesses only. `guess_recall` scores the recorded guesses, near and far, against
what the layers then routed to: whether guessing further ahead is worth its reads, on paper.
"""

from __future__ import annotations

import bisect
import csv
import heapq
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sluice.errors import SluiceError
from sluice.storage.trace import Trace, TraceRecord

POLICIES = ("lru", "lfu", "fifo", "belady")
Key = tuple[int, int]


class _Cache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: OrderedDict[Key, None] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self.keys

    def access(self, key: Key, now: int) -> bool:
        """A demand use: True on a hit; a miss inserts the key."""
        if key in self.keys:
            self.touch(key, now)
            return True
        self.insert(key, now)
        return False

    def touch(self, key: Key, now: int) -> None:
        self.keys.move_to_end(key)

    def insert(self, key: Key, now: int, protect: frozenset = frozenset(), use: bool = True) -> bool:
        """Bring key in, evicting a block not in `protect` (blocks the engine holds pinned). False: no room.
        `use=False`: a guess, not a demand (lfu does not count it)."""
        if self.capacity <= 0 or key in self.keys:
            return False
        if len(self.keys) >= self.capacity:
            victim = self.victim(now, protect)
            if victim is None:
                return False
            del self.keys[victim]
        self.keys[key] = None
        self.inserted(key, now, use)
        return True

    def inserted(self, key: Key, now: int, use: bool = True) -> None:
        pass

    def victim(self, now: int, protect: frozenset) -> Key | None:
        return next((k for k in self.keys if k not in protect), None)  # least recently used first


class _FIFO(_Cache):
    def touch(self, key, now):
        pass


class _LFU(_Cache):
    def __init__(self, capacity):
        super().__init__(capacity)
        self.count: dict[Key, int] = defaultdict(int)

    def touch(self, key, now):
        self.count[key] += 1
        super().touch(key, now)

    def inserted(self, key, now, use=True):
        self.count[key] += use

    def victim(self, now, protect):
        keys = [k for k in self.keys if k not in protect]  # ties: least recently used (first in order)
        return min(keys, key=lambda k: self.count[k]) if keys else None


class _Belady(_Cache):
    """Evicts the resident block whose next demand is furthest away (never: first)."""

    def __init__(self, capacity, uses: dict[Key, list[int]]):
        super().__init__(capacity)
        self.uses = uses
        self.heap: list[tuple[int, Key]] = []

    def _next(self, key: Key, now: int) -> int:
        times = self.uses.get(key, ())
        i = bisect.bisect_right(times, now)
        return times[i] if i < len(times) else 1 << 62

    def touch(self, key, now):
        heapq.heappush(self.heap, (-self._next(key, now), key))

    def inserted(self, key, now, use=True):
        heapq.heappush(self.heap, (-self._next(key, now), key))

    def victim(self, now, protect):
        skipped, found = [], None
        while self.heap:
            neg, key = heapq.heappop(self.heap)
            if key in self.keys and -neg == self._next(key, now):
                if key in protect:
                    skipped.append((neg, key))
                    continue
                found = key
                break
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found if found is not None else next((k for k in self.keys if k not in protect), None)


def _make(policy: str, capacity: int, uses) -> _Cache:
    if policy not in POLICIES:
        raise SluiceError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    return {"lru": lambda: _Cache(capacity), "fifo": lambda: _FIFO(capacity), "lfu": lambda: _LFU(capacity),
            "belady": lambda: _Belady(capacity, uses)}[policy]()


@dataclass
class SimResult:
    ram_blocks: int
    vram_blocks: int
    policy: str
    tokens: int
    blocks: dict[str, int] = field(default_factory=lambda: {"vram": 0, "ram": 0, "disk": 0})
    prefetch_reads: int = 0
    vram_prefetches: int = 0  # guesses copied into VRAM ahead
    vram_prefetch_hits: int = 0  # demand VRAM hits on such a copy

    @property
    def disk_per_token(self) -> float:
        return self.blocks["disk"] / max(self.tokens, 1)

    @property
    def hit_rate(self) -> float:
        total = sum(self.blocks.values())
        return 1 - self.blocks["disk"] / total if total else 0.0

    def per_token(self) -> dict[str, float]:
        return {t: n / max(self.tokens, 1) for t, n in self.blocks.items()}


def guess_recall(trace: Trace) -> tuple[float | None, float | None]:
    """(next layer, two or more MoE layers ahead): of the blocks each layer routed to, the share the recorded guesses
    for it named (None where the trace holds no such guesses). A run whose VRAM tier the trace records
    (direct-stream) guessed only blocks VRAM lacked, so there the share is of the blocks not read from VRAM."""
    lacking = trace.header.get("vram_tier") == "recorded"
    by_step = {(r.step, r.layer): r for r in trace.records}

    def needed(r: TraceRecord) -> set[int]:
        return {e for e, v in zip(r.experts, r.from_vram()) if not v} if lacking else set(r.experts)

    near, far = [0, 0], [0, 0]  # (guessed and routed, routed)
    for r in trace.records:
        if r.predicted is not None:
            routed = needed(r)
            near[0] += len(routed & set(r.predicted))
            near[1] += len(routed)
        for layer, guesses in r.further:
            target = by_step.get((r.step, layer))
            if target is not None:
                routed = needed(target)
                far[0] += len(routed & set(guesses))
                far[1] += len(routed)
    return tuple(hit / total if total else None for hit, total in (near, far))


def simulate(trace: Trace, ram_blocks: int, vram_blocks: int = 0, policy: str = "lru", prefetch: bool | None = None,
             decode_only: bool = False, vram_prefetch: bool | None = None, depth: int | None = None,
             vram_as_recorded: bool | None = None) -> SimResult:
    """Replay `trace` with the given tier sizes (in blocks). decode_only counts only one-token steps. prefetch and
    vram_prefetch (guesses read into RAM; copied into VRAM) default to what the recorded run did; depth (MoE layers
    guessed ahead, at most the recorded run's) to all the trace holds. A trace of direct-stream ("vram_tier":
    "recorded") keeps its VRAM tier as recorded: `vram_blocks` is ignored, and the blocks the run read from VRAM are
    VRAM hits that leave RAM untouched; `vram_as_recorded=False` replays them as any other block (`sluice plan`: a RAM
    cache alone, or a VRAM tier of `vram_blocks` slots)."""
    if depth is not None and depth < 1:
        raise SluiceError(f"depth must be >= 1 (the next MoE layer), got {depth}")
    recorded = trace.header.get("vram_tier") == "recorded" if vram_as_recorded is None else vram_as_recorded
    if recorded:
        vram_blocks, vram_prefetch = 0, False
    prefetch = trace.header.get("prefetch", False) if prefetch is None else prefetch
    vram_prefetch = trace.header.get("vram_prefetch", False) if vram_prefetch is None else vram_prefetch
    guessed: set[Key] = set()  # copied into VRAM on a guess and not yet routed to
    records = trace.records
    uses: dict[Key, list[int]] = defaultdict(list)
    t = 0
    for r in records:
        for e, v in zip(r.experts, r.from_vram()):
            if not (recorded and v):  # a recorded VRAM hit is no use of RAM
                uses[(r.layer, e)].append(t)
            t += 1
    ram, vram = _make(policy, ram_blocks, uses), _make(policy, vram_blocks, uses)
    res = SimResult(ram_blocks, vram_blocks, policy, 0)
    counted_steps = set()
    now = 0
    for i, r in enumerate(records):
        count = not decode_only or r.tokens == 1
        if count and r.step not in counted_steps:
            counted_steps.add(r.step)
            res.tokens += r.tokens
        # as fetch and h2d do: every VRAM lookup first, then the misses take slots (the layer's blocks held)
        hits = r.from_vram() if recorded else [vram_blocks > 0 and (r.layer, e) in vram for e in r.experts]
        for j, e in enumerate(r.experts):
            key = (r.layer, e)
            if hits[j]:
                if not recorded:
                    vram.touch(key, now + j)
                tier = "vram"
                if key in guessed and count:
                    res.vram_prefetch_hits += 1
            else:
                tier = "ram" if ram.access(key, now + j) else "disk"
            guessed.discard(key)
            if count:
                res.blocks[tier] += 1
        # pinned by the layer's copies and compute (direct-stream pins only the blocks it reads from RAM)
        held = frozenset((r.layer, e) for j, e in enumerate(r.experts) if not (recorded and hits[j]))
        if vram_blocks:
            for j, e in enumerate(r.experts):
                if not hits[j]:
                    vram.insert((r.layer, e), now + j, held)
        now += len(r.experts)
        nxt = records[i + 1] if i + 1 < len(records) else None
        # guesses that can be copied into VRAM: in RAM before this layer's prefetch reads (which will not have
        # landed when h2d copies) and still there after them (those reads may evict some)
        copyable = [(nxt.layer, e) for e in nxt.predicted if (nxt.layer, e) in ram] if nxt is not None and nxt.predicted else []
        if prefetch and nxt is not None and (nxt.predicted or r.further):
            further = r.further if depth is None else r.further[: depth - 1]
            res.prefetch_reads += _prefetch(ram, vram, ((nxt.layer, nxt.predicted or ()), *further), now, held)
        if vram_prefetch and vram_blocks and r.tokens == 1 and copyable:
            for key in copyable:
                if key in vram or key not in ram:
                    continue
                if not vram.insert(key, now, held, use=False):
                    break
                guessed.add(key)
                res.vram_prefetches += 1
    return res


def _prefetch(ram, vram, guesses, now: int, held: frozenset) -> int:
    """Read (layer, experts) guesses, nearest layer first, into RAM where neither tier holds them; the reads made. Like
    the engine, the first guess with no free or evictable slot ends the prefetch."""
    reads = 0
    for layer, experts in guesses:
        for e in experts:
            key = (layer, e)
            if key not in ram and key not in vram:
                if not ram.insert(key, now, held, use=False):  # a guess, as `Runtime.read_guess` takes its slot
                    return reads
                reads += 1
    return reads


def sweep(trace: Trace, sizes: list[int], vram_blocks: int = 0, policy: str = "lru", prefetch: bool | None = None,
          vram_prefetch: bool | None = None, depth: int | None = None) -> list[SimResult]:
    return [simulate(trace, n, vram_blocks, policy, prefetch, vram_prefetch=vram_prefetch, depth=depth) for n in sizes]


def write_sweep(results: list[SimResult], block_bytes: int, csv_path: Path, png_path: Path | None) -> None:
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ram_blocks", "ram_gib", "vram_blocks", "policy", "hit_rate", "disk_reads_per_token", "prefetch_reads"])
        for r in results:
            w.writerow([r.ram_blocks, f"{r.ram_blocks * block_bytes / 2**30:.4f}", r.vram_blocks, r.policy,
                        f"{r.hit_rate:.4f}", f"{r.disk_per_token:.3f}", r.prefetch_reads])
    if png_path is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SluiceError("the PNG needs matplotlib (pip install matplotlib); the CSV was written") from None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    gib = [r.ram_blocks * block_bytes / 2**30 for r in results]
    ax.plot(gib, [100 * r.hit_rate for r in results], marker="o")
    ax.set_xlabel("RAM cache (GiB)")
    ax.set_ylabel("expert block hit rate (%)")
    ax.set_title(f"Routing replay, {results[0].policy}" + (f", {results[0].vram_blocks} VRAM slots" if results[0].vram_blocks else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
