"""The device table the `via: table` stages share: where each routed block lies, and what a step keeps between tokens.

A device table gives each (MoE layer, expert) its block's byte offset from one base: a VRAM slot for the blocks the
VRAM tier holds, else the block's pinned RAM slot, which the expert kernels read over PCIe themselves (zero-copy;
64-bit addresses reach host memory on CUDA). The fast path's stages (route, predict, fetch, h2d, compute `via:
table`, and combine) are each a part of a one-token step that pipeline/plan.py composes from the schedule and
captures as one CUDA graph per MoE layer, so the host queues a whole decode step without a round trip to the GPU.
Outputs are bit-identical to the streaming schedules' (the same kernels on the same bytes, the same sum), but for one
case: with no VRAM tier the bank is host memory, for which the re-laid down kernel declares its rows aligned, and on
a GPU its FP4 / FP8 partial sums then add in another order (equal within fp32 rounding; tests/test_kernels.py).

The table and its host sides, in four files (a prompt runs the stages' host faces: pipeline/plan.py `TokenPlan.layer`):
- table.py: the shared state (tier, RAM blocks, staging lists, counters, kernels, a prompt's copies ahead) and the
  one-token steps the composed step does not run whole (`token_layer`);
- table_stream.py: `hold: false`'s one-token steps (the ids to the host, misses read from disk, then the plan's step);
- storage/vram_tier.py: the VRAM tier of the most routed blocks (fetch's `vram`, refreshed every `refresh` one-token steps
  from use counts made on the GPU) and the device table;
- table_ram.py: the RAM side: every block held (fetch's `hold: true`, the default: `--ram-cache` at least the store's
  expert bytes), or an LRU cache filled from disk (`hold: false`).

With `hold: true` routed ids stay on the GPU, so no routing trace is recorded (`hold: false` records: `record`). A
trace (--trace) shows a `direct` span per MoE layer and, inside it, the span of each stage the step is composed of
(route, predict, fetch, compute, combine: `Tracer.phase`), as GPU spans the layer's CUDA graph records on each replay.

`hold: false` (schedules/direct-stream.yaml) is for stores larger than RAM: the RAM tier is an LRU cache of at least
one layer's experts, and every step brings the routed ids to the host (one wait per MoE layer); the blocks a layer
routes to that neither VRAM nor RAM holds are read from disk (demand reads), and the layer's blocks stay pinned in
RAM until its kernels and copies are queued. A one-token step of a block with pure functions (`graph_safe`) brings the
next MoE layer's guesses (its router on this input) with its ids, reads those neither tier holds as guesses
(`prefetch`: on the reader's guess queue, behind every demand read), sends the step the offsets it found its blocks
at (VRAM or RAM slots; one copy) and runs the plan's step on those ids and offsets (no staging lookahead: a guess's
block may not be in RAM); other blocks' one-token steps take the prompts' path. The VRAM tier's refreshes and a
prompt's copies ahead take only blocks in RAM.

compute's `routed: false` skips the routed experts (their kernels, and loading their blocks at open): each MoE layer
still routes and runs its shared expert and its own projections, with a zero routed sum. The outputs are not the
model's; what it is for is the performance issue's roofline term "the resident part's own time, measured alone"
(schedules/resident-alone.yaml, `sluice bench model --resident-alone`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from sluice.errors import ScheduleError
from sluice.kernels.rates import PairRate
from sluice.stages.compute import expert_backend, triton_experts
from sluice.stages.table_cpu import CpuSteps
from sluice.stages.table_ram import RamBlocks
from sluice.stages.table_stream import StreamedSteps
from sluice.stages.types import LayerInput
from sluice.storage.vram_tier import VramTier


@dataclass(frozen=True)
class TableKnobs:
    """The `via: table` stages' knobs in one place, read as attributes (each declared, with its comment, by the stage it
    belongs to: route's `shared`; fetch's `vram`, `refresh`, `hold`...; h2d's `token_ahead`, `prompt_*`; compute's
    `backend`, `routed`...), and `predict`: whether the schedule has the predict stage (guesses staged ahead)."""

    values: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


class Table(StreamedSteps, CpuSteps):
    name = "direct"  # the span a one-token MoE layer's step is traced under

    def __init__(self, knobs: TableKnobs, rt, stream: str = "compute"):
        self.knobs, self.rt, self.stream = knobs, rt, stream
        backend = expert_backend("compute", knobs.backend, rt.device)
        self.step: Callable | None = None  # the plan's one-token step of a layer (pipeline/plan.py `TokenPlan.step`)
        self.split: Callable | None = None  # ... and of a layer whose blocks the CPU shares (`TokenPlan.split`)
        if rt.recorder is not None and (knobs.hold or not knobs.routed):
            raise ScheduleError("stage 'fetch' with hold: true keeps routed ids on the GPU and records no routing trace: "
                                "record with hold: false (schedules/direct-stream.yaml) or a streaming schedule (e.g. overlap)")
        self.backend = backend
        if knobs.cpu_share and not knobs.hold:
            raise ScheduleError("stage 'compute': 'cpu_share' needs every block held in RAM (fetch's hold: true)")
        self.cpu_share = knobs.cpu_share if knobs.routed and backend == "triton" else 0.0  # stages/table_cpu.py
        self.cpu_now = bool(self.cpu_share)  # cpu_share: this token's steps share blocks with the CPU (`cpu_choose`)
        self._cpu_plain = 0  # ... tokens since the last that did
        self._cpu_retimed = False  # ... a token gave the CPU blocks the balance did not, and they timed it again
        self._cpu_forced = False  # ... this token's counts are such blocks (`cpu_counts`)
        self._cpu_probe = 0  # ... tokens with the share since the last whose counts give the CPU one more (`cpu_counts`)
        self._cpu_gave_up: tuple | None = None  # ... the GPU's waits for the host gave up: (on the device, its pinned copy)
        self._cpu: dict = {}  # cpu_share: (kind, act) -> the CPU's expert kernels
        self._cpu_credit = 0.0  # cpu_share: the CPU's share of blocks carried across layers
        self._zero: tuple | None = None  # cpu_share: (a zero block on the device, its aligned start in it)
        self._cpu_bufs: dict = {}  # cpu_share, split on the device: MoE index -> its buffers (stages/table_cpu.py)
        self._cpu_outside: dict[int, int] = {}  # ... MoE index -> its blocks outside VRAM at its last step
        self._cpu_seq = 0  # ... the token's number
        self._cpu_dev: tuple | None = None  # ... on the device: (each layer's counts by blocks outside VRAM, the token's
        # number, the zero block's offset)
        store, dev = rt.store, rt.device
        self.layers = list(store.moe_layers)  # MoE index -> model layer
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.stream_ram = knobs.routed and not knobs.hold  # RAM is a cache: blocks read from disk when routed to
        vram = rt.vram if knobs.vram and knobs.routed and rt.vram is not None and rt.vram.capacity else None
        base = self.base = (vram.arena if vram is not None else rt.ram.arena).data
        self.blocks = RamBlocks(rt, self.layers, base, knobs.routed and knobs.hold, self.stream_ram, stream)
        triton = backend == "triton" and knobs.routed
        self.tier = VramTier(knobs, rt, self.layers, vram, self.blocks.off, self.blocks.resident, stream, banks=triton,
                         staging=triton and knobs.predict and not self.stream_ram, stream_ram=self.stream_ram)
        self.num_experts, self.block_bytes = store.manifest.num_experts, store.block_bytes
        if self.cpu_share:
            self._cpu_dev = (torch.zeros(len(self.layers), store.manifest.top_k + 1, dtype=torch.int64, device=dev),
                             torch.zeros(1, dtype=torch.int64, device=dev),
                             torch.full((), self._zero_offset(), dtype=torch.int64, device=dev))
        self.vram_served = torch.zeros((), dtype=torch.int64, device=dev)  # one-token steps' blocks read from VRAM
        self.staged_served = torch.zeros((), dtype=torch.int64, device=dev)  # ... read from the staging bank
        self.staged_copies = torch.zeros((), dtype=torch.int64, device=dev)  # blocks copied into it (guesses, right or wrong)
        self.token_blocks = 0  # one-token steps' routed blocks (host count)
        self.rows_blocks = torch.zeros((), dtype=torch.int64, device=dev)  # batched decode rows' blocks (each layer's union)
        self.token_disk = 0  # ... read from disk (stream_ram)
        self.token_vram = 0  # ... read from VRAM (stream_ram: the host resolves them)
        self._seen = (0, 0, 0, 0, 0, 0, 0)  # (vram_served, staged_served, staged_copies, token_blocks, token_disk, token_vram,
        # rows_blocks) counted
        S = self.tier.S  # one-token lookahead: blocks a staging half holds
        self.guess_ids = torch.full((2, S), -1, dtype=torch.int64, device=dev)  # by the guessed layer's parity: global ids
        self.guess_src = torch.zeros(2, S, dtype=torch.int64, device=dev)  # ... and their RAM offsets (predict's)
        self.held = torch.full((2, S), -1, dtype=torch.int64, device=dev)  # what each staging half holds (copies landed)
        self.copied: list = [None, None]  # per half: the event after its copies, for the step's stream to wait on (h2d's)
        self.ahead_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and S else None  # the staging copies' stream
        self.num_experts, self.block_bytes = store.manifest.num_experts, store.block_bytes
        self.ahead: tuple | None = None  # a prompt's copies ahead (h2d's `look_ahead`): (MoE index, {expert: offset},
        # copy event, [(i, e, slot)] tier slots it filled)
        self.cpu_ahead: tuple | None = None  # prompt_cpu: (MoE index, the most rows of its CPU's blocks), chosen by the
        # layer before as it copied the others ahead (h2d's)
        self.prompt_rate = PairRate()  # prompt_cpu: the CPU's seconds over a prompt layer's (block, row) pairs (compute's)
        self._kernels = {}
        self.graphs = None  # CUDA graphs of one-token steps (the plan's) and of `hold: false`'s routers
        if knobs.graphs and backend == "triton" and dev.type == "cuda":
            from sluice.kernels.graphs import FnGraphs

            self.graphs = FnGraphs(rt.pools)
        self._routers = {}  # stream_ram: each MoE layer's router, for the ids its one-token steps bring to the host
        self._guessed: dict[int, tuple[int, ...]] = {}  # stream_ram, recording: MoE layer -> the guesses made for it
        self._offs: dict[int, torch.Tensor] = {}  # stream_ram: per MoE index, the device offsets its one-token steps read
        self._landing_of: tuple | None = None  # stream_ram: (tier.landing, its (i, e) as a set), made once per refresh
        self.staging: torch.Tensor | None = None  # prompts: 2 x prompt_group block slots in VRAM (h2d's)
        self.staged: list = [None, None]  # per staging half: the event after the compute that last read it
        rt.stats.sources.append(self._flush_counts)

    # -- the layer step --------------------------------------------------------------------------

    async def token_layer(self, li: LayerInput) -> torch.Tensor | None:
        """A one-token step the plan's composed step does not run whole: of a block whose MoE input is not pure (the
        composed step on x, residual), or over a RAM cache (`hold: false`: routed on the host, misses read, then the
        composed step); None where the step's ids must come to the host first (prompts, the torch backend, a block
        with impure MoE functions over a RAM cache: the stages' host faces, pipeline/plan.py `TokenPlan.layer`)."""
        block = li.block
        i = self.index[block.layer]
        if li.x.shape[0] != 1 or self.backend != "triton":
            return None
        if not self.stream_ram:
            if self.cpu_now:
                return await self._token_cpu(li, i)
            return self.step(block, li.next_block, None, (li.x, li.residual))
        if i == 0:
            self.between_tokens()
        if block.graph_safe:
            return await self._token_streamed(li, i)
        return None

    def record(self, layer: int, i: int, ids: list[int], experts: list[int], vram: set[int], further=()) -> None:
        """stream_ram with --record-routing: the layer's routing as fetch records it (a tier per expert: the blocks the
        step reads from VRAM, those `blocks.ensure` read from disk, the rest from RAM), with the guesses the step of
        the MoE layer before made for it (those the VRAM tier lacked: what it offered the reader), and `further`: this
        step's guesses for the layers after the next one (`depth` > 1), as ((layer, experts), ...)."""
        if i == 0:
            self._guessed.clear()  # a step that ended early (an error) left its guesses for layers it did not reach
        tiers = ["vram" if e in vram else "disk" if e in self.blocks.disk else "ram" for e in experts]
        self.rt.recorder.layer(layer, ids, tuple(experts), tiers, self._guessed.pop(layer, None), further)

    def kernel(self, block):
        return triton_experts(self._kernels, self.rt, block, False, self.knobs.fp4_matvec)  # the whole layer is one graph here

    # -- the VRAM tier (storage/vram_tier.py)  ---------------------------------------------------

    def empty_vram(self) -> None:
        """Point every table entry back at its RAM slot and leave the VRAM tier as at open (the host has synchronized:
        no copy is in flight); `sluice bench model` times a prompt on the tier as opened with it."""
        if self.tier.vram is not None:
            self.ahead = None  # its moves are in the tier's slot_of: pointed back with the rest
            self.tier.empty()

    def between_tokens(self, defer: bool = False) -> None:
        """At a one-token step's first MoE layer: the tier's turn (storage/vram_tier.py VramTier.between_tokens)."""
        self.settle_ahead()  # a prompt's copies ahead for a layer it did not reach (an error): keep the slots it filled
        self.tier.between_tokens(defer)
        if self.cpu_now:
            self.cpu_token_begins()

    def _flush_counts(self) -> None:
        """Add one-token steps' and batched decode rows' blocks per tier to the I/O counters (reads device counters:
        syncs)."""
        now = (int(self.vram_served), int(self.staged_served), int(self.staged_copies), self.token_blocks, self.token_disk,
               self.token_vram, int(self.rows_blocks))
        dv, ds, dc, db, dd, dh, dr = (a - b for a, b in zip(now, self._seen))
        dv += dh
        db += dr
        stats = self.rt.stats
        stats.blocks["vram"] += dv + ds  # a staged block is read from VRAM; its copy is counted as a guess copied ahead
        stats.blocks["disk"] += dd
        stats.blocks["ram"] += db - dv - ds - dd
        stats.vram_prefetches += dc
        stats.vram_prefetch_hits += ds
        self._seen = now

    # -- a prompt's copies ahead (h2d's `look_ahead`), read by the next layer's step ------------------------------

    def copied_ahead(self, i: int) -> dict[int, int]:
        """MoE index i's blocks that the layer before copied ahead: expert -> offset of its copy."""
        return self.ahead[1] if self.ahead is not None and self.ahead[0] == i else {}

    def drop_stale_ahead(self, i: int) -> None:
        """Copies ahead made for a step that did not come (an error): settled, keeping the slots they filled."""
        if self.ahead is not None and self.ahead[0] != i:
            self.settle_ahead()

    def settle_ahead(self) -> None:
        """The step's stream waits for the copies ahead; tier slots they filled are pointed at."""
        if self.ahead is None:
            return
        _, _, landed, filled = self.ahead
        self.ahead = None
        self.rt.streams.wait(self.stream, landed)
        self.tier.point(filled, vram=True)

    def unfill(self, filled: list[tuple[int, int, int]]) -> None:
        """Give back free tier slots a step planned to fill (it failed before it pointed the table at them)."""
        for i, e, slot in filled:
            if self.tier.slot_of.get((i, e)) == slot:
                del self.tier.slot_of[(i, e)]
                self.tier.free.append(slot)
