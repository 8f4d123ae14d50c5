"""direct: a MoE layer's whole step on the GPU, each expert read where it lies; decode never waits for routed ids.

A device table gives each (MoE layer, expert) its block's byte offset from one base: a VRAM slot for the blocks the
VRAM tier holds, else the block's pinned RAM slot, which the expert kernels read over PCIe themselves (zero-copy;
64-bit addresses reach host memory on CUDA). A one-token step is one CUDA graph per MoE layer, so the host queues a
whole decode step without a round trip to the GPU. Outputs are bit-identical to the streaming schedules' (the same
kernels on the same bytes, the same sum), but for one case: with no VRAM tier the bank is host memory, for which the
re-laid down kernel declares its rows aligned, and on a GPU its FP4 / FP8 partial sums then add in another order
(equal within fp32 rounding; tests/test_kernels.py).

The stage in five files:
- direct.py: the knobs, the layer step's dispatch (`run`), the counters;
- direct_token.py: one-token steps (one graph a layer; the next layer's blocks staged ahead: `token_ahead`);
- direct_prompt.py: prompts (the ids to the host, blocks copied group by group; the next layer's copied ahead);
- direct_tier.py: the VRAM tier of the most routed blocks (`vram`, refreshed every `refresh` one-token steps from use
  counts made on the GPU) and the device table;
- direct_ram.py: the RAM side: every block held (`hold: true`, the default: `--ram-cache` at least the store's expert
  bytes), or an LRU cache filled from disk (`hold: false`).

The default keeps routed ids on the GPU, so it records no routing traces (`hold: false` does: `_record`). A trace
(--trace) shows a `direct` span per MoE layer and, inside it, one span per stage the step fuses (route, predict,
fetch, compute, combine: `Tracer.phase`), as GPU spans the layer's CUDA graph records itself on every replay.

`hold: false` (schedules/direct-stream.yaml) is for stores larger than RAM: the RAM tier is an LRU cache of at least
one layer's experts, and every step brings the routed ids to the host (one wait per MoE layer); the blocks a layer
routes to that neither VRAM nor RAM holds are read from disk (demand reads), and the layer's blocks stay pinned in
RAM until its kernels and copies are queued. A one-token step of a block with pure functions (`graph_safe`) brings the
next MoE layer's guesses (its router on this input) with its ids, reads those neither tier holds as guesses
(`prefetch`: on the reader's guess queue, behind every demand read), sends the step the offsets it found its blocks
at (VRAM or RAM slots; one copy) and runs the step `hold: true` runs, on those ids and offsets (no staging lookahead:
a guess's block may not be in RAM); other blocks' one-token steps take the prompts' path. The VRAM tier's refreshes
and a prompt's copies ahead take only blocks in RAM.

`routed: false` skips the routed experts (their kernels, and loading their blocks at open): each MoE layer still
routes and runs its shared expert and its own projections, with a zero routed sum. The outputs are not the
model's; what it is for is the performance issue's roofline term "the resident part's own time, measured alone"
(schedules/resident-alone.yaml, `sluice bench model --resident-alone`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.errors import ScheduleError
from sluice.stages.base import Stage, StageIO
from sluice.stages.compute import check_fp4_matvec, expert_backend, torch_expert, triton_experts
from sluice.stages.direct_prompt import PromptSteps
from sluice.stages.direct_ram import RamBlocks
from sluice.stages.direct_tier import Tier
from sluice.stages.direct_token import TokenSteps
from sluice.stages.route import group_by_expert
from sluice.stages.types import LayerInput, LayerOutput


@dataclass(frozen=True)
class DirectKnobs:
    backend: str = "auto"  # auto (triton on CUDA, torch on a CPU) | triton | torch
    zero_skip: bool = False  # ReLU^2 down reads only live 16-neuron groups
    graphs: bool = True  # a one-token layer step replays one CUDA graph (CUDA, triton backend)
    vram: bool = True  # keep the most routed blocks in the VRAM tier's slots
    refresh: int = 16  # one-token steps between VRAM tier updates
    decay: float = 0.5  # weight of older counts at each update (0: only the last `refresh` steps count)
    margin: float = 1.0  # a block replaces a VRAM one only when its decayed count beats that one's by more than this
    prompt_group: int = 8  # prompts: RAM blocks copied to VRAM this many at a time, double-buffered (0: read in place)
    prompt_fill: bool = True  # prompts: a RAM block copied while the VRAM tier has a free slot is copied into the slot and stays
    prompt_ahead: int = 32  # prompts: the next MoE layer's blocks, guessed by its router on this layer's input, copied
    # while this layer computes: into free tier slots (as many as are free), then up to this many into a bank of
    # 2 x this many of the tier's slots (at most half of them), which one-token steps lend back to the tier; 0: off
    fp4_matvec: str = "auto"  # one-token NVFP4 / FP8 formulation: f16x2 | words | auto (stages/compute.py fp4_formulation)
    routed: bool = True  # false: skip the routed experts (times the resident part alone; outputs are not the model's)
    hold: bool = True  # every block read into pinned RAM at open and held; false: RAM is an LRU cache filled from disk
    prefetch: bool = True  # hold: false: one-token steps also read the next MoE layer's guessed blocks (its router on
    # this layer's input) that neither tier holds from disk, as guesses (only while no demand read is queued or running)
    depth: int = 1  # hold: false, prefetch: MoE layers guessed ahead (their routers on this layer's input): 1 is the next
    # one; more add the layers after it, read behind the nearer layers' guesses (as predict's knob)
    guess_extra: int = 0  # hold: false, prefetch: the next MoE layer's guesses go this many experts past its top-k (its
    # router's ranking on this layer's input), read after every other guess: a router whose choice moves a little
    # between layers then finds more of its blocks in RAM; needs a router that ranks (MoEBlock.ranked: NemotronH);
    # a routing trace (--record-routing) records the top-k guesses only, so `sluice simulate` leaves these out
    readers: int = 8  # reader threads (as fetch's knob: one pool for the engine; hold: true reads every block at open)
    guess_reads: int = 2  # hold: false: guesses read at once, at most (as fetch's knob: a drive that needs depth wants
    # more; fewer than `readers`, so that a demand read finds a thread; with read_pieces > 1, pieces of guesses)
    read_pieces: int = 1  # a block read as this many parts at once by the pool's threads, in the order asked for (as
    # fetch's knob)
    host_hint: bool = False  # with a VRAM tier: one-token steps' re-laid down kernel declares rows 16-byte aligned: wider
    # zero-copy loads for the blocks it reads from RAM (`sluice bench kernels --mixed`), but on a GPU FP4 / FP8 partial
    # sums then add in another order, so outputs are no longer bit-identical to the streaming schedules'
    token_ahead: int = 8  # one-token steps: of the next MoE layer's guessed experts (its router on this layer's input),
    # the first this many whose blocks VRAM lacks are copied from RAM into a staging bank of the tier's slots (two
    # halves, by the layer's parity) on a stream of their own, under the resident layers before that layer, which
    # then reads them there instead of over PCIe; 0: off (blocks outside VRAM read in place)
    shared: str = "side"  # the block's shared term (its shared expert): side (one-token steps run it on a stream of its
    # own beside the router and routed experts; prompts before their wait for the ids) | late (after the routed sum)

    def __post_init__(self):
        if self.shared not in ("side", "late"):
            raise ScheduleError(f"stage 'direct': 'shared' must be side or late, got {self.shared!r}")
        for knob in ("depth", "readers", "guess_reads", "read_pieces"):
            if getattr(self, knob) < 1:
                raise ScheduleError(f"stage 'direct': {knob!r} must be >= 1, got {getattr(self, knob)!r}")
        if self.guess_extra < 0:
            raise ScheduleError(f"stage 'direct': 'guess_extra' must be >= 0, got {self.guess_extra!r}")
        for knob, default, what in (("depth", 1, "guesses layers ahead"), ("guess_extra", 0, "guesses past the top-k")):
            if getattr(self, knob) > default and (self.hold or not self.prefetch):
                raise ScheduleError(f"stage 'direct': {knob!r} {getattr(self, knob)} {what} for reads from disk: it needs "
                                    f"hold: false and prefetch: true")


class Direct(TokenSteps, PromptSteps, Stage):
    name = "direct"
    consumes = ("layer",)
    produces = "output"
    Knobs = DirectKnobs

    @classmethod
    def needs(cls, k: DirectKnobs) -> dict:
        ram = "one" if not k.routed else "all" if k.hold else "cache"
        return {"readers": k.readers, "guess_reads": k.guess_reads, "read_pieces": k.read_pieces, "ram": ram,
                "depth": k.depth, "guess_extra": k.guess_extra, "whole_layer": True}

    def __init__(self, knobs: DirectKnobs, stream: str, rt):
        super().__init__(knobs, stream, rt)
        backend = expert_backend(self.name, knobs.backend, rt.device)
        check_fp4_matvec(self.name, knobs.fp4_matvec)
        if not 0.0 <= knobs.decay <= 1.0:
            raise ScheduleError(f"stage 'direct': 'decay' must be in [0, 1], got {knobs.decay!r}")
        if knobs.margin < 0:
            raise ScheduleError(f"stage 'direct': 'margin' must be >= 0, got {knobs.margin!r}")
        if knobs.prompt_ahead < 0:
            raise ScheduleError(f"stage 'direct': 'prompt_ahead' must be >= 0, got {knobs.prompt_ahead!r}")
        if knobs.refresh < 1:
            raise ScheduleError(f"stage 'direct': 'refresh' must be >= 1, got {knobs.refresh!r}")
        if rt.recorder is not None and (knobs.hold or not knobs.routed):
            raise ScheduleError("stage 'direct' with hold: true keeps routed ids on the GPU and records no routing trace: "
                                "record with hold: false (schedules/direct-stream.yaml) or a streaming schedule (e.g. overlap)")
        self.backend = backend
        store, dev = rt.store, rt.device
        self.layers = list(store.moe_layers)  # MoE index -> model layer
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.stream_ram = knobs.routed and not knobs.hold  # RAM is a cache: blocks read from disk when routed to
        vram = rt.vram if knobs.vram and knobs.routed and rt.vram is not None and rt.vram.capacity else None
        base = self.base = (vram.arena if vram is not None else rt.ram.arena).data
        self.blocks = RamBlocks(rt, self.layers, base, knobs.routed and knobs.hold, self.stream_ram, stream)
        triton = backend == "triton" and knobs.routed
        self.tier = Tier(knobs, rt, self.layers, vram, self.blocks.off, self.blocks.resident, stream, banks=triton,
                         staging=triton and not self.stream_ram, stream_ram=self.stream_ram)
        self.vram_served = torch.zeros((), dtype=torch.int64, device=dev)  # one-token steps' blocks read from VRAM
        self.staged_served = torch.zeros((), dtype=torch.int64, device=dev)  # ... read from the staging bank
        self.staged_copies = torch.zeros((), dtype=torch.int64, device=dev)  # blocks copied into it (guesses, right or wrong)
        self.token_blocks = 0  # one-token steps' routed blocks (host count)
        self.token_disk = 0  # ... read from disk (stream_ram)
        self.token_vram = 0  # ... read from VRAM (stream_ram: the host resolves them)
        self._seen = (0, 0, 0, 0, 0, 0)  # (vram_served, staged_served, staged_copies, token_blocks, token_disk, token_vram) counted
        S = self.tier.S  # one-token lookahead: blocks a staging half holds
        self._guess_ids = torch.full((2, S), -1, dtype=torch.int64, device=dev)  # by the guessed layer's parity: global ids
        self._guess_src = torch.zeros(2, S, dtype=torch.int64, device=dev)  # ... and their RAM offsets
        self._held = torch.full((2, S), -1, dtype=torch.int64, device=dev)  # what each staging half holds (copies landed)
        self._copied: list = [None, None]  # per half: the event after its copies, for the compute stream to wait on
        self._ahead: tuple | None = None  # (MoE index, {expert: offset}, copy event, [(i, e, slot)] tier slots it filled)
        self._kernels = {}
        self._graphs = None
        if knobs.graphs and backend == "triton" and dev.type == "cuda":
            from sluice.kernels.graphs import FnGraphs

            self._graphs = FnGraphs(rt.pools)
        self._steppers = {}
        self._marks: dict[tuple, list] = {}  # per stepper, with a trace: the `Tracer.phase` marks its graph records
        self._routers = {}  # stream_ram: each MoE layer's router, for the ids its one-token steps bring to the host
        self._guessed: dict[int, tuple[int, ...]] = {}  # stream_ram, recording: MoE layer -> the guesses made for it
        self._offs: dict[int, torch.Tensor] = {}  # stream_ram: per MoE index, the device offsets its one-token steps read
        self._landing_of: tuple | None = None  # stream_ram: (tier.landing, its (i, e) as a set), made once per refresh
        # one-token steps: the stream of the shared term and the next layer's guess, forked from the stage's and joined
        # before the layer's output; and the staging copies' stream
        cuda = dev.type == "cuda"
        self._side = torch.cuda.Stream(dev) if cuda and (knobs.shared == "side" or S) else None
        self._ahead_stream = torch.cuda.Stream(dev) if cuda and S else None
        self._staging: torch.Tensor | None = None  # prompts: 2 x prompt_group block slots in VRAM
        self._staged: list = [None, None]  # per staging half: the event after the compute that last read it
        rt.stats.sources.append(self._flush_counts)

    # -- the layer step --------------------------------------------------------------------------

    async def run(self, io: StageIO) -> LayerOutput:
        li: LayerInput = await io.value("layer")
        block, T = li.block, li.x.shape[0]
        i = self.index[block.layer]
        token = T == 1 and self.backend == "triton"
        if token and not self.stream_ram:
            return LayerOutput(self._token(block, li.next_block, None, li.x, li.residual))
        if token and i == 0:
            self._between_tokens()
        if token and block.graph_safe:  # stream_ram: the routed ids to the host, misses read, then the same step
            return LayerOutput(await self._token_streamed(li, i))
        self.tier.land(wait=True)  # a prompt reads the slots the host believes in: wait for their copies
        if not token:
            self.tier.reclaim_bank()
        # prompts' lookahead: the next MoE layer's router on this layer's input, its ids brought back with these
        ahead = self.knobs.prompt_ahead and self.knobs.routed and self.backend == "triton" and li.next_block is not None \
            and self.tier.vram is not None and not token
        with self.rt.streams.use(self.stream):
            weights, ids = block.router(li.x)
            xe = block.expert_input(li.x)
            self.tier.uses[i].index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
            both = torch.cat((ids, li.next_block.guessed(li.x)[1].to(ids.dtype)), dim=1) if ahead else ids
        host, arrived = self.rt.streams.to_host(self.stream, both)
        shared = None
        if block.shared is not None and self.knobs.shared == "side":  # the GPU runs it while the host waits for the ids
            with self.rt.streams.use(self.stream):
                shared = block.shared(li.x)
        await self.rt.ids_arrived(arrived)
        ids_cpu, guess = (host[:, : ids.shape[1]], host[:, ids.shape[1]:]) if ahead else (host, None)
        flat = ids_cpu.flatten().long()
        experts = torch.unique(flat).tolist() if self.knobs.routed else []  # ascending
        try:
            if self.stream_ram:  # the blocks read from RAM: not those in VRAM, nor those the layer before copied ahead
                early = self._copied_ahead(i)
                need = experts if self.backend != "triton" else \
                    [e for e in experts if (i, e) not in self.tier.slot_of and e not in early]
                await self.blocks.ensure(block.layer, i, need)
                if self.rt.recorder is not None:
                    self._record(block.layer, i, flat.tolist(), experts, set(experts) - set(need))
            return self._layer_step(li, block, i, T, weights, ids, xe, ids_cpu, flat, experts, guess, shared)
        finally:
            self.blocks.release()  # also after a failed read: the engine's recovery then drops every RAM block

    def _record(self, layer: int, i: int, ids: list[int], experts: list[int], vram: set[int], further=()) -> None:
        """stream_ram with --record-routing: the layer's routing as fetch records it (a tier per expert: the blocks the
        step reads from VRAM, those `blocks.ensure` read from disk, the rest from RAM), with the guesses the step of
        the MoE layer before made for it (those the VRAM tier lacked: what it offered the reader), and `further`: this
        step's guesses for the layers after the next one (`depth` > 1), as ((layer, experts), ...)."""
        if i == 0:
            self._guessed.clear()  # a step that ended early (an error) left its guesses for layers it did not reach
        tiers = ["vram" if e in vram else "disk" if e in self.blocks.disk else "ram" for e in experts]
        self.rt.recorder.layer(layer, ids, tuple(experts), tiers, self._guessed.pop(layer, None), further)

    def _layer_step(self, li, block, i, T, weights, ids, xe, ids_cpu, flat, experts, guess, shared) -> LayerOutput:
        with self.rt.streams.use(self.stream):
            y = torch.empty(T * block.top_k, xe.shape[1], dtype=block.combine_dtype, device=xe.device)
            w = weights.reshape(-1)
            if not self.knobs.routed:
                y.zero_()
            elif self.backend == "triton":
                self._prompt_experts(block, i, flat, experts, xe, w, y)
                if guess is not None:
                    self._look_ahead(self.index[li.next_block.layer], guess.flatten().long())
            else:
                for e in experts:
                    self.rt.stats.tier("vram" if (i, e) in self.tier.slot_of else "disk" if e in self.blocks.disk else "ram")
                self._torch(block, *group_by_expert(ids_cpu.long(), li.x.device), xe, w, y)
            routed = y.view(T, block.top_k, -1).sum(dim=1).to(li.x.dtype)
            h = li.residual + block.output(routed, li.x, shared).view_as(li.residual)
        return LayerOutput(h)

    def _kernel(self, block):
        return triton_experts(self._kernels, self.rt, block, False, self.knobs.fp4_matvec)  # the whole layer is one graph here

    def _torch(self, block, experts, rows, xe, w, y) -> None:
        """The plain-torch reference path, each expert from its RAM slot."""
        for e in experts:
            torch_expert(self.rt.store, block, self.rt.store.logical(self.blocks.entries[(block.layer, e)].buf), rows[e], xe, w, y)

    # -- the VRAM tier (stages/direct_tier.py) ---------------------------------------------------

    def empty_vram(self) -> None:
        """Point every table entry back at its RAM slot and free the VRAM tier's slots (the host has synchronized:
        no copy is in flight); `sluice bench model` times a prompt on an empty tier with it."""
        if self.tier.vram is not None:
            self._ahead = None  # its moves are in the tier's slot_of: pointed back with the rest
            self.tier.empty()

    def _between_tokens(self) -> None:
        """At a one-token step's first MoE layer: the tier's turn (stages/direct_tier.py Tier.between_tokens)."""
        self._settle_ahead()  # a prompt's copies ahead for a layer it did not reach (an error): keep the slots it filled
        self.tier.between_tokens()

    def _flush_counts(self) -> None:
        """Add one-token steps' blocks per tier to the I/O counters (reads a device counter: syncs)."""
        now = (int(self.vram_served), int(self.staged_served), int(self.staged_copies), self.token_blocks, self.token_disk,
               self.token_vram)
        dv, ds, dc, db, dd, dh = (a - b for a, b in zip(now, self._seen))
        dv += dh
        stats = self.rt.stats
        stats.blocks["vram"] += dv + ds  # a staged block is read from VRAM; its copy is counted as a guess copied ahead
        stats.blocks["disk"] += dd
        stats.blocks["ram"] += db - dv - ds - dd
        stats.vram_prefetches += dc
        stats.vram_prefetch_hits += ds
        self._seen = now
