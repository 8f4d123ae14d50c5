"""What the stages share for the engine's lifetime: store, reader pool, memory tiers, streams, trace, counters.

Memory tiers (DESIGN.md): VRAM slots (a bank of block-sized buffers; on a CPU only when asked for, emulated
in host memory) -> host RAM
LRU (pinned when CUDA) -> disk. All bookkeeping happens on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from sluice.kernels.graphs import GraphPools
from sluice.errors import ScheduleError
from sluice.kernels.layout import proj_layouts
from sluice.kernels.rates import CpuRate
from sluice.pipeline.streams import Streams
from sluice.pipeline.trace import Tracer
from sluice.storage.cache import BlockCache, CacheEntry
from sluice.storage.reader import BlockReader, HostArena
from sluice.storage.store import ExpertStore
from sluice.storage.trace import RoutingRecorder

TIERS = ("vram", "ram", "disk")
RECALL_KEEP = 0.9  # weight of the recall measured so far at each MoE layer's new share (`IOStats.guesses_pay`)


@dataclass
class IOStats:
    """Expert I/O counters since the engine opened. `snapshot()` copies; subtract two for a request."""

    blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # routed blocks served per tier
    prefetch_reads: int = 0  # blocks read ahead on a guess
    prefetch_hits: int = 0  # demand RAM hits on a block that a prefetch brought in
    vram_prefetches: int = 0  # blocks copied RAM -> VRAM ahead on a guess (h2d prefetch)
    vram_prefetch_hits: int = 0  # demand VRAM hits on a block that a guess copied
    vram_fills: int = 0  # blocks copied RAM -> VRAM when the direct schedule refreshes its hot set
    refreshes: int = 0  # the direct schedule's hot-set refreshes
    refresh_s: float = 0.0  # the host's time in them (the counts read back, the choice, the copies queued)
    refresh_wait_s: float = 0.0  # ... of which waiting for the counts (the GPU's work queued before them)
    guesses_skipped: int = 0  # guessed blocks not read or copied ahead: the recent recall was below `min_recall`
    predicted: int = 0  # guesses made for layers that then ran
    predicted_right: int = 0  # guesses the layer then routed to
    routed_predicted: int = 0  # experts routed in layers that had a prediction
    further_right: int = 0  # guesses made two or more MoE layers ahead (a depth > 1) that the layer then routed to
    further_routed: int = 0  # experts routed in layers that had such a guess, once per guess list
    stall_s: float = 0.0  # time fetch waited for reads to land
    ids_wait_s: float = 0.0  # time the host waited for routed ids to arrive from the GPU (the GPU's queued work before them)
    # () -> the reader's counts (BlockReader.counts: the drive's busy time, reads timed by kind): the engine's, not a
    # request's (a request's difference of them counts any read that overlapped its turns)
    reader: Callable[[], dict] | None = field(default=None, repr=False)
    cpu_blocks: int = 0  # blocks the hybrid path computed on the CPU instead of copying them
    cpu_prompt_s: float = 0.0  # the CPU's time in a prompt's share (h2d's prompt_cpu: its worker's calls)
    steps: int = 0
    tokens: int = 0
    kernels: list = field(default_factory=list, repr=False)  # TritonExperts, for live-group counts
    sources: list = field(default_factory=list, repr=False)  # callables adding device-side counts into these (sync)
    _guesses: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, repr=False)  # (layer, ahead) ->
    _recall: float | None = field(default=None, repr=False)  # recent share of the next layer's guesses routed to

    def tier(self, tier: str, prefetched: bool = False) -> None:
        self.blocks[tier] += 1
        self.prefetch_hits += prefetched

    def observe_prediction(self, layer: int, guesses: tuple[int, ...], ahead: int = 1) -> None:
        """Guesses for MoE layer `layer`, made `ahead` MoE layers before it (1: by the layer before)."""
        self._guesses[(layer, ahead)] = guesses

    def observe_routing(self, layer: int, experts: tuple[int, ...]) -> tuple[int, ...] | None:
        """Score the guesses made for this layer against what it routed to; returns those of the layer before."""
        routed = set(experts)
        for ahead in [a for (l, a) in self._guesses if l == layer and a > 1]:
            self.further_right += len(set(self._guesses.pop((layer, ahead))) & routed)
            self.further_routed += len(routed)
        guesses = self._guesses.pop((layer, 1), None)
        if guesses is not None:
            right = len(set(guesses) & routed)
            self.predicted += len(guesses)
            self.predicted_right += right
            self.routed_predicted += len(experts)
            if guesses:
                share = right / len(guesses)
                self._recall = share if self._recall is None else RECALL_KEEP * self._recall + (1 - RECALL_KEEP) * share
        return guesses

    def guesses_pay(self, min_recall: float, n: int) -> bool:
        """Whether guesses are worth reading or copying ahead: the recent recall of the next layer's guesses (an
        average over the last ~1 / (1 - RECALL_KEEP) MoE layers) is at least `min_recall`, or none is measured yet. If
        not, the `n` guessed blocks count as skipped; prediction itself goes on, so the recall keeps being measured."""
        if not min_recall or self._recall is None or self._recall >= min_recall:
            return True
        self.guesses_skipped += n
        return False

    def counters(self, device: bool = False) -> dict:
        """The counters as plain numbers: cheap, with no GPU sync, unless `device` first adds the counts kept on
        the GPU (`sources`: the direct schedule's blocks per tier), which waits for the GPU's queued work."""
        if device:
            for add in self.sources:
                add()
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k not in ("kernels", "sources", "reader")}
        d["blocks"] = dict(self.blocks)
        if self.reader is not None:
            d.update(self.reader())
        return d

    def counters_since(self, before: dict, device: bool = False) -> dict:
        return _diff(self.counters(device), before)

    def snapshot(self) -> dict:
        """All counters, with the device-side ones (`sources`, the kernels' live groups; reading those syncs the GPU)."""
        d = self.counters(device=True)
        d["live_groups"] = sum(int(k.live_groups) for k in self.kernels)
        d["total_groups"] = sum(k.total_groups for k in self.kernels)
        return d

    def since(self, before: dict) -> dict:
        """Counters accumulated since `before` (an earlier snapshot)."""
        return _diff(self.snapshot(), before)


def _diff(now: dict, before: dict) -> dict:
    d = {k: now[k] - before[k] for k in now if k != "blocks"}
    d["blocks"] = {t: now["blocks"][t] - before["blocks"][t] for t in TIERS}
    return d


class Runtime:
    def __init__(
        self,
        store: ExpertStore,
        device: torch.device,
        ram_blocks: int,
        vram_blocks: int,
        readers: int,
        verify: bool,
        direct_io: bool,
        trace: str | None = None,
        down_in_ram: bool = False,
        record_routing: RoutingRecorder | None = None,
        vram_policy: str = "lru",
        guess_reads: int = 2,
        read_pieces: int = 1,
    ):
        self.store = store
        self.device = device
        self.streams = Streams(device)
        self.pools = GraphPools()  # every CUDA graph this engine captures takes its memory from these (kernels/graphs.py)
        self.tracer = Tracer(self.streams, trace)
        self.reader = BlockReader(store, threads=readers, direct=direct_io, verify=verify, guesses=guess_reads,
                                  pieces=read_pieces)
        self.guessed: dict[int, list[CacheEntry]] = {}  # layer -> RAM entries read ahead for it on a guess
        cuda = device.type == "cuda"
        self.ram = BlockCache(HostArena(ram_blocks, store.block_bytes, pin=cuda))
        # the VRAM tier; on a CPU only when asked for (vram_blocks > 0): then an emulated one in host memory
        self.vram = BlockCache(_DeviceArena(vram_blocks, store.block_bytes, device), vram_policy) if vram_blocks else None
        self.stats = IOStats(reader=self.reader.counts)
        self.recorder = record_routing
        self.layouts = proj_layouts(store.manifest.formats, store.manifest.slots)
        # hybrid miss path: the CPU's measured seconds for its expert blocks (kernels/rates.py), the pinned H2D rate
        self.cpu_rate = CpuRate()
        self.h2d_bps: float | None = None  # `h2d_rate`
        # zero-copy down: h2d copies only up, compute reads down from the pinned RAM slot
        self.down_in_ram = down_in_ram and "down" in self.layouts

    def h2d_rate(self) -> float:
        """The pinned host-to-device rate in bytes a second, measured at first use (64 MiB copies)."""
        if self.h2d_bps is None:
            from sluice.kernels.rates import h2d_bandwidth

            self.h2d_bps = h2d_bandwidth(self.device, 64 << 20)
        return self.h2d_bps

    def logical(self, buf: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        return self.store.logical(buf)

    async def ids_arrived(self, event) -> None:
        """Wait for routed ids on their way to the host (`Streams.to_host`'s event), timed as `ids_wait_s`: the GPU
        work queued before them that the host could not run ahead of."""
        t = time.perf_counter()
        await self.streams.arrived(event)
        self.stats.ids_wait_s += time.perf_counter() - t

    def read(self, layer: int, expert: int, entry: CacheEntry, guess: bool = False) -> asyncio.Future:
        """Start reading block (layer, expert) into entry's slot (a `guess` after demand reads); the future
        completes on the loop."""
        after = entry.reuse_after  # kept on the entry: a read cancelled before it waited hands it to the slot's next entry
        fut = entry.job = self.reader.submit(layer, expert, entry.buf, after=after, guess=guess)
        if self.tracer.enabled:
            self.tracer.read_started(layer, expert, fut)
        return asyncio.wrap_future(fut)

    def demand(self, layer: int, expert: int, count: bool = True) -> tuple[str, CacheEntry | None]:
        """Pin block (layer, expert) in the RAM tier for this layer's use, without waiting: ("ram", entry) a hit
        (landed, or a read in flight: await entry.ready); ("guess", entry) a hit on a guess read ahead (landed or
        in flight); ("disk", entry) a miss whose demand read has started, or a guess not yet started now read as a
        demand; ("disk", None) a miss with no slot to take (`demand_wait`, once the caller has let go what it can).
        With `count`, a promoted guess leaves the prefetch count (it is counted once, as a disk block)."""
        key = (layer, expert)
        entry = self.ram.lookup(key)
        if entry is None:
            entry = self.ram.try_reserve(key)
            if entry is not None:
                entry.ready = self.read(layer, expert, entry)
            return "disk", entry
        self.ram.pin(entry)
        promoted = entry.loading and entry.prefetched and self.reader.promote(entry.job)
        self.stats.prefetch_reads -= promoted and count
        kind = "disk" if promoted else "guess" if entry.prefetched else "ram"
        entry.prefetched = False
        return kind, entry

    async def demand_wait(self, layer: int, expert: int) -> CacheEntry:
        """The miss `demand` found no slot for: a slot awaited (released by a consumer; the caller cancels the guesses
        not started first, `cancel_guesses`, so theirs go to demands) and its demand read started."""
        entry = await self.ram.reserve((layer, expert))
        entry.ready = self.read(layer, expert, entry)
        return entry

    def read_guess(self, layer: int, expert: int) -> bool:
        """Read block (layer, expert) into a free or evictable RAM slot as a guess (the reader takes it only while no
        demand read is queued or running); False when no slot can be had."""
        entry = self.ram.try_reserve((layer, expert), use=False)
        if entry is None:
            return False
        entry.prefetched = True
        entry.ready = self.read(layer, expert, entry, guess=True)
        entry.ready.add_done_callback(lambda f, e=entry: self.settle_prefetch(e, f))
        self.guessed.setdefault(layer, []).append(entry)
        self.stats.prefetch_reads += 1
        return True

    def settle_prefetch(self, entry: CacheEntry, fut: asyncio.Future) -> None:
        """A prefetch read finished: keep the block, or drop it if the read failed or was cancelled (a demand will
        retry and report)."""
        entry.job = None
        if fut.cancelled() or fut.exception() is not None:
            entry.pins -= 1
            self.ram.discard(entry)
        else:
            self.ram.unpin(entry)

    def cancel_guesses(self, layer: int | None = None, keep: set[int] = frozenset()) -> int:
        """Cancel the guesses still queued (for `layer`, whose list is then done with; else every layer's) but those of
        experts in `keep`; a cancelled guess's slot is freed once the loop sees the cancellation. How many."""
        n = 0
        for entries in ([self.guessed.pop(layer, [])] if layer is not None else list(self.guessed.values())):
            for e in entries:
                if e.key[1] not in keep and e.prefetched and e.loading and e.job is not None and self.reader.cancel(e.job):
                    self.stats.prefetch_reads -= 1  # never read
                    n += 1
        return n

    async def recover(self) -> None:
        """After a failed step: let in-flight reads settle (guesses not started are cancelled), then drop every
        cached block and pin."""
        self.cancel_guesses()
        reads = [e.ready for e in self.ram.entries() if e.ready is not None]
        if reads:
            await asyncio.gather(*reads, return_exceptions=True)  # also marks failed reads as seen
        self.streams.synchronize()
        self.guessed.clear()
        self.ram.clear()
        if self.vram is not None:
            self.vram.clear()

    def load_hot_set(self, trace_path: str, reserve: int) -> int:
        """Load the blocks a routing trace routed to most often into the VRAM tier and hold them there,
        leaving `reserve` slots to the rest; returns how many were loaded."""
        from collections import Counter

        from sluice.storage.trace import read_trace

        trace, m = read_trace(trace_path), self.store.manifest
        if trace.header.get("architecture") != m.architecture or trace.header.get("num_experts") != m.num_experts:
            raise ScheduleError(f"hot_set {trace_path}: recorded on {trace.header.get('architecture')} with "
                                f"{trace.header.get('num_experts')} experts, this store is {m.architecture} with {m.num_experts}")
        layers = set(self.store.moe_layers)
        counts = Counter((r.layer, e) for r in trace.records if r.layer in layers for e in r.experts)
        staging = HostArena(1, self.store.block_bytes, pin=self.device.type == "cuda")
        n = 0
        for key, _ in counts.most_common(max(0, self.vram.capacity - reserve)):
            self.reader.submit(key[0], key[1], staging.slot(0)).result()
            entry = self.vram.try_reserve(key)
            entry.buf.copy_(staging.slot(0))
            self.vram.hold(entry)
            self.vram.unpin(entry)
            n += 1
        return n

    def close(self) -> None:
        self.reader.close()
        self.tracer.close()
        if self.recorder is not None:
            self.recorder.close()


class _DeviceArena:
    """`n` block-sized slots in one device allocation (the VRAM slot bank)."""

    def __init__(self, n: int, nbytes: int, device: torch.device):
        self.n, self.nbytes = n, nbytes
        self.data = torch.empty(n * nbytes, dtype=torch.uint8, device=device)

    def slot(self, i: int) -> torch.Tensor:
        return self.data[i * self.nbytes : (i + 1) * self.nbytes]
