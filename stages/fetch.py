"""fetch: find each routed expert's block in the fastest tier and bring misses into RAM.

For each distinct expert of the layer: a VRAM-slot hit passes through (and, when `down` is read
zero-copy from RAM, still needs its RAM copy); a RAM hit is pinned and
emitted at once; a miss reserves a RAM slot and goes to the reader pool, and is emitted when its
read lands (so copies of hits start while reads are in flight). When the RAM tier has no slot
to give, the stage ends a wave and waits for a consumer to release one: a layer's experts may
pass through a small cache in turns.

Prefetch: once every demand read of the layer has landed, the predicted experts of the next MoE
layer (and, with the predict stage's `depth`, of the layers after it, nearest first) are read into free
or evictable slots, never evicting a pinned block. They go to the reader as guesses: a guess starts only
while no demand read is queued or running, `guess_reads` at most at once, so they do not share the drive
with demand reads. When a layer runs, its guesses still queued are read at once if it routed to them and
dropped if it did not. With `min_recall`, guesses are read only while the recent share of them the layers went on
to route to is at least that (`IOStats.guesses_pay`): wrong guesses cost the drive and RAM slots for nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sluice.errors import ScheduleError
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import HostBlock, Prediction, Routing


@dataclass(frozen=True)
class FetchKnobs:
    prefetch: bool = False  # read the predicted experts of the next layer after demand reads
    readers: int = 8  # reader threads (one pool for the engine; the schedule's value sizes it)
    guess_reads: int = 2  # prefetch reads in flight at most (a drive that needs depth to reach its rate wants more;
    # the reader keeps one of two or more threads for demand reads; with read_pieces > 1, pieces of guesses)
    read_pieces: int = 1  # a block read as this many parts at once by the pool's threads, in the order asked for
    min_recall: float = 0.0  # read guesses only while their recent recall is at least this (0: always)

    def __post_init__(self):
        if self.guess_reads < 1:
            raise ScheduleError(f"stage 'fetch': 'guess_reads' must be >= 1, got {self.guess_reads} (prefetch: false "
                                f"reads no guesses)")
        if self.read_pieces < 1:
            raise ScheduleError(f"stage 'fetch': 'read_pieces' must be >= 1, got {self.read_pieces}")
        if not 0.0 <= self.min_recall <= 1.0:
            raise ScheduleError(f"stage 'fetch': 'min_recall' must be between 0 and 1, got {self.min_recall!r}")


class Fetch(Stage):
    name = "fetch"
    consumes = ("layer", "routing")
    optional = ("prediction",)
    produces = "blocks"
    channel = True
    Knobs = FetchKnobs

    @classmethod
    def needs(cls, knobs: FetchKnobs) -> dict:
        return {"readers": knobs.readers, "guess_reads": knobs.guess_reads, "read_pieces": knobs.read_pieces}

    async def run(self, io: StageIO) -> None:
        routing: Routing = await io.value("routing")
        layer = (await io.value("layer")).block.layer
        rt = self.rt
        pending: dict[asyncio.Future, HostBlock] = {}
        tiers = []
        rt.cancel_guesses(layer, keep=set(routing.experts))  # this layer's guesses still queued that it did not route to
        for expert in routing.experts:
            key = (layer, expert)
            v = rt.vram.lookup(key) if rt.vram is not None else None
            if v is not None:
                rt.vram.pin(v)
                rt.stats.tier("vram")
                rt.stats.vram_prefetch_hits += v.prefetched
                v.prefetched = False
                tiers.append("vram")
                if not rt.down_in_ram:
                    io.emit(HostBlock(expert, "vram", None, v))
                    continue
            kind, entry = rt.demand(layer, expert, count=v is None)
            tier = "ram" if kind == "guess" else kind
            if v is None:
                rt.stats.tier(tier, prefetched=kind == "guess")
                tiers.append(tier)
            if entry is None:  # no slot: guesses not started give theirs up; what was emitted goes on as a wave
                rt.cancel_guesses()
                await self._drain(io, pending)
                io.end_wave()
                entry = await rt.demand_wait(layer, expert)
            hb = HostBlock(expert, tier, entry, v)
            if entry.loading:
                pending[entry.ready] = hb
            else:
                io.emit(hb)
        await self._drain(io, pending)
        io.end_wave()
        pred = await io.value("prediction") if self.knobs.prefetch and io.has("prediction") else None
        if rt.recorder is not None:
            further = pred.further if pred is not None and pred.layer is not None else ()
            rt.recorder.layer(layer, routing.ids.flatten().tolist(), routing.experts, tiers, routing.predicted, further)
        if pred is not None:
            self._prefetch(pred)

    async def _drain(self, io: StageIO, pending: dict[asyncio.Future, HostBlock]) -> None:
        """Emit pending blocks as their reads land; time spent here is stall."""
        t0 = time.perf_counter()
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                hb = pending.pop(fut)
                fut.result()  # a failed read raises here, naming layer and expert
                io.emit(hb)
        self.rt.stats.stall_s += time.perf_counter() - t0

    def _prefetch(self, pred: Prediction) -> None:
        rt = self.rt
        if pred.layer is None or not rt.stats.guesses_pay(self.knobs.min_recall, len(pred.experts)):
            return
        for layer, experts in ((pred.layer, pred.experts), *pred.further):
            for expert in experts:
                key = (layer, expert)
                if key in rt.ram or (rt.vram is not None and key in rt.vram):
                    continue
                if not rt.read_guess(layer, expert):
                    return
