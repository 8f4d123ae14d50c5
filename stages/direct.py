"""direct: a MoE layer's whole step on the GPU, each expert read where it lies; decode never waits for routed ids.

Every routed block of the model is read once into the pinned RAM cache and held there. A device
table gives each (MoE layer, expert) its block's byte offset from one base: a VRAM slot for the
blocks the VRAM tier holds, else the pinned RAM slot, which the expert kernels read over PCIe
themselves (zero-copy; 64-bit addresses reach host memory on CUDA). A one-token step routes on the
GPU, gathers the K offsets from the table, runs the layer's expert kernels on them, sums the K
weighted outputs in combine's fixed order and finishes the layer: one CUDA graph per layer (the
stage's `graphs`, for models whose MoE functions are pure: `MoEBlock.graph_safe`; others run the same
step eagerly), so the host enqueues a whole decode step without a round trip to the GPU. Outputs
are bit-identical to the streaming schedules' (the same kernels on the same bytes, the same sum), but for one case:
with no VRAM tier the bank is host memory, for which the re-laid down kernel declares its rows aligned, and on a
GPU its FP4 / FP8 partial sums then add in another order (equal within fp32 rounding; tests/test_kernels.py).

One-token lookahead (`token_ahead`, with a VRAM tier): each step also runs the next MoE layer's router on its input
(on a side stream, with the shared expert: `shared`), and of those guesses, the first S whose blocks the tier lacks are
copied from RAM into half of a staging bank of tier slots (kernels/ahead.py: ids chosen and copied on the GPU, the
host never sees them) on a stream of their own, after the step: under the resident layers before the next MoE layer.
That layer waits for the copies, then resolves each routed id to the tier's slot, else a staging slot holding that
block, else its RAM slot. Blocks are bytes that never change, so a slot is read only once its copy has landed and the
result is the same wherever a block is read from.

VRAM tier (`vram`): the most routed blocks are kept in VRAM slots, chosen anew every `refresh` one-token steps from
use counts made on the GPU (stages/direct_tier.py, which also keeps the device table).

Prompts (T > 1): the ids come to the host (one wait per layer); the grouped GEMM reads the blocks in VRAM
from their slots, and the rest after the copy stream has brought them, `prompt_group` at a time, into a
small staging bank (double-buffered, so a group's copies run under the previous group's GEMMs). While the
VRAM tier has free slots (`prompt_fill`), a block is copied into a slot instead and stays there: the copy
is paid for anyway, and the next prompt, or the first decode steps, find it in VRAM.

Needs every block in RAM (`--ram-cache` at least the store's expert bytes) and keeps routed ids on the
GPU, so it does not record routing traces; the trace shows one `direct` span per MoE layer.

`hold: false` (schedules/direct-stream.yaml) is for stores larger than RAM: the RAM tier is an LRU cache of at least
one layer's experts, and every step brings the routed ids to the host (one wait per MoE layer); the blocks a layer
routes to that neither VRAM nor RAM holds are read from disk (demand reads), and the layer's blocks stay pinned in
RAM until its kernels and copies are queued (their slots then wait for that GPU work before a new block is read in).
Prompts then take the prompts' path. A one-token step of a block with pure functions (`graph_safe`) brings the next
MoE layer's guesses (its router on this input) with its ids, reads those neither tier holds as guesses (`prefetch`:
on the reader's guess queue, behind every demand read), sends the step the offsets it found its blocks at (VRAM
or RAM slots; one copy) and runs the step `hold: true` runs, on those ids and offsets (no staging lookahead: a guess's block may not be in RAM); other
blocks' one-token steps take the prompts' path. The VRAM tier's refreshes and a prompt's copies ahead take only
blocks in RAM.

`routed: false` skips the routed experts (their kernels, and loading their blocks at open): each MoE layer still
routes and runs its shared expert and its own projections, with a zero routed sum. The outputs are not the
model's; what it is for is the performance issue's roofline term "the resident part's own time, measured alone"
(schedules/resident-alone.yaml, `sluice bench model --resident-alone`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from sluice.errors import ScheduleError
from sluice.kernels.ahead import resolve, select, stage_copy
from sluice.stages.base import Stage, StageIO
from sluice.stages.compute import check_fp4_matvec, expert_backend, torch_expert, triton_experts
from sluice.stages.direct_ram import RamBlocks
from sluice.stages.direct_tier import Tier
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


class Direct(Stage):
    name = "direct"
    consumes = ("layer",)
    produces = "output"
    Knobs = DirectKnobs

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
        if rt.recorder is not None:
            raise ScheduleError("stage 'direct' keeps routed ids on the GPU and records no routing trace: "
                                "record with a streaming schedule (e.g. overlap)")
        self.backend = backend
        store, dev = rt.store, rt.device
        self.layers = list(store.moe_layers)  # MoE index -> model layer
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        E = store.manifest.num_experts
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
            from sluice.pipeline.graphs import FnGraphs

            self._graphs = FnGraphs()
        self._steppers = {}
        self._routers = {}  # stream_ram: each MoE layer's router, for the ids its one-token steps bring to the host
        self._host: dict[int, tuple] = {}  # stream_ram: per MoE index, its one-token steps' buffers (`_host_bufs`)
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
            both = torch.cat((ids, li.next_block.router(li.x)[1].to(ids.dtype)), dim=1) if ahead else ids
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
            if self.stream_ram:
                need = experts if self.backend != "triton" else [e for e in experts if (i, e) not in self.tier.slot_of]
                await self.blocks.ensure(block.layer, i, need)
            return self._layer_step(li, block, i, T, weights, ids, xe, ids_cpu, flat, experts, guess, shared)
        finally:
            self.blocks.release()  # also after a failed read: the engine's recovery then drops every RAM block

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

    def _prompt_experts(self, block, i, flat, experts, xe, w, y) -> None:
        """A prompt's experts (flat: its routed ids [T*K], CPU): those in VRAM from their slots; those the previous layer
        copied ahead (`prompt_ahead`) once their copies land; those in RAM (with `prompt_group`) copied into a staging
        bank group by group on the copy stream, each group computed once its copies land while the next is copied (the
        copy engine moves them faster than a GEMM reading host memory row tile by row tile); else in place. The host's
        work per layer is one sort of the (token, k) positions into the groups' order, so that each group's rows are one
        slice, and one copy of every group's block offsets."""
        kern, K, bb, streams = self._kernel(block), block.top_k, self.rt.store.block_bytes, self.rt.streams
        tier = self.tier
        G, E = self.knobs.prompt_group, tier.table.shape[1]
        if self._ahead is not None and self._ahead[0] != i:  # copied for a step that did not come (an error): keep the slots
            self._settle_ahead()
        early = self._ahead[1] if self._ahead is not None else {}  # expert -> offset of its copy ahead
        in_vram = [e for e in experts if (i, e) in tier.slot_of and e not in early]
        ahead = [e for e in experts if e in early]
        in_ram = [e for e in experts if (i, e) not in tier.slot_of and e not in early]
        for e in experts:
            self.rt.stats.tier("vram" if e in in_vram else "disk" if e in self.blocks.disk else "ram")
        self.rt.stats.vram_prefetch_hits += len(ahead)
        ram_groups = [in_ram[s : s + G] for s in range(0, len(in_ram), G)] if G else [in_ram] if in_ram else []
        rank = torch.zeros(E, dtype=torch.int64)
        rank[in_vram + ahead + in_ram] = torch.arange(len(experts))
        rows = torch.argsort(rank[flat], stable=True).to(xe.device, non_blocking=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        if G and in_ram and self._staging is None:
            self._staging = torch.empty(2 * G * bb, dtype=torch.uint8, device=self.rt.device)
        offsets = [tier.offset(i, e) for e in in_vram] + [early[e] for e in ahead]
        copies, filled = [], []  # per RAM group [(expert, destination)]; (i, e, slot) copied into free VRAM tier slots
        for g, group in enumerate(ram_groups):
            dsts = []
            for j, e in enumerate(group):
                if not G:
                    offsets.append(self.blocks.off[i][e])
                    continue
                if self.knobs.prompt_fill and tier.free:  # a free slot is read by no kernel: the copy needs no wait
                    slot = tier.slot_of[(i, e)] = tier.free.pop()
                    filled.append((i, e, slot))
                    dst = tier.vram.arena.slot(slot)
                else:
                    dst = self._staging[((g % 2) * G + j) * bb : ((g % 2) * G + j + 1) * bb]
                dsts.append((e, dst))
                offsets.append(dst.data_ptr() - self.base.data_ptr())
            copies.append(dsts)
        offs = torch.tensor(offsets, dtype=torch.int64).to(xe.device, non_blocking=True)
        at = [0, 0]  # the next group's first expert in offs, first row in rows

        def compute(group):
            n, c = len(group), [counts[e] for e in group]
            kern.run(self.base, offs[at[0] : at[0] + n], self.base, offs[at[0] : at[0] + n], c, rows[at[1] : at[1] + sum(c)], K,
                     xe, w, y, self.knobs.zero_skip)
            at[0] += n
            at[1] += sum(c)

        try:
            if in_vram:
                compute(in_vram)
            self._settle_ahead()  # the compute stream waits for the copies ahead; their tier slots are pointed at
            if ahead:
                compute(ahead)
            if not G:
                if in_ram:
                    compute(in_ram)
            else:
                for g, (group, dsts) in enumerate(zip(ram_groups, copies)):
                    half = g % 2
                    with streams.use("copy"):
                        streams.wait("copy", self._staged[half])
                        for e, dst in dsts:
                            dst.copy_(self.blocks.entries[(block.layer, e)].buf, non_blocking=True)
                        landed = streams.record("copy")
                    streams.wait(self.stream, landed)
                    compute(group)
                    self._staged[half] = streams.record(self.stream)
            if early:
                tier.ahead_read[i % 2] = streams.record(self.stream)  # the lookahead bank's half for this layer is read
        except BaseException:  # tier slots planned for copies that may not have been queued: free again, unread
            self._unfill(filled)
            raise
        self.rt.stats.vram_fills += len(filled)
        tier.point(filled, vram=True)  # after the waits above: the table points at the slots once their copies have landed

    def _look_ahead(self, i: int, guess: torch.Tensor) -> None:
        """Copy MoE layer i's blocks that its router, run on the previous layer's input, chose for the prompt's tokens
        (`guess`, flat ids, CPU; most chosen first), behind the copies already queued: into free VRAM tier slots, else
        into the lookahead bank's half for i's parity (once the compute that last read it is done). Layer i reads them
        from there, once they land; a guess it did not route to was a wasted copy."""
        tier = self.tier
        counts = torch.bincount(guess, minlength=tier.table.shape[1])
        order = torch.argsort(counts, descending=True, stable=True)[: int((counts > 0).sum())].tolist()
        bank = iter(tier.ahead_bank[i % 2])
        early, filled, moves = {}, [], []
        layer = self.layers[i]
        for e in order:
            if (i, e) in tier.slot_of or (src := self.blocks.resident(layer, e)) is None:
                continue
            if self.knobs.prompt_fill and tier.free:
                slot = tier.slot_of[(i, e)] = tier.free.pop()
                filled.append((i, e, slot))
            else:
                slot = next(bank, None)
                if slot is None:
                    break
            early[e] = slot * self.rt.store.block_bytes
            moves.append((e, slot, src))
        if not moves:
            return
        streams = self.rt.streams
        try:
            with streams.use("copy"):
                streams.wait("copy", tier.ahead_read[i % 2])
                for e, slot, src in moves:
                    tier.vram.arena.slot(slot).copy_(src.buf, non_blocking=True)
                landed = streams.record("copy")
            tier.read_by([src for _, _, src in moves], landed)
        except BaseException:
            self._unfill(filled)
            raise
        self.rt.stats.vram_prefetches += len(moves)
        self._ahead = (i, early, landed, filled)

    def _unfill(self, filled: list[tuple[int, int, int]]) -> None:
        """Give back free tier slots a step planned to fill (it failed before it pointed the table at them)."""
        for i, e, slot in filled:
            if self.tier.slot_of.get((i, e)) == slot:
                del self.tier.slot_of[(i, e)]
                self.tier.free.append(slot)

    def _settle_ahead(self) -> None:
        """The compute stream waits for the copies ahead (`_look_ahead`); tier slots they filled are pointed at."""
        if self._ahead is None:
            return
        _, _, landed, filled = self._ahead
        self._ahead = None
        self.rt.streams.wait(self.stream, landed)
        self.tier.point(filled, vram=True)

    def token(self, layer, h: torch.Tensor, next_block=None) -> torch.Tensor | None:
        """A one-token step of MoE `layer` whole, from its input h [1, 1, D] (the norm before the experts included,
        so one graph replay is the layer's whole host cost); None where this stage cannot (the torch backend, a
        MoE input that is not a pure function)."""
        block = layer.moe
        if self.backend != "triton" or not block.graph_safe or self.stream_ram:
            return None
        with self.rt.tracer.span(self.name, layer=block.layer, stream=self.stream):
            return self._token(block, next_block, layer, h)

    async def _token_streamed(self, li: LayerInput, i: int) -> torch.Tensor:
        """stream_ram, a one-token step: the router's ids come to the host (the one wait; with `prefetch`, the next MoE
        layer's guesses with them, read behind the demands), the routed blocks the VRAM tier does not serve are brought
        into RAM (demand reads from disk for the misses) and pinned; then the layer's step runs as `direct`'s does, on
        these ids and on the offsets the host found them at (the blocks checked are the blocks read), sent with one
        copy instead of pointing the table at them (`Tier.point`: several launches a layer)."""
        block, nxt = li.block, li.next_block if self.knobs.prefetch else None
        K = block.top_k
        with self.rt.streams.use(self.stream):
            weights, ids, both = self._router(block, nxt)(li.x)
        # per MoE layer, pinned buffers this step alone uses: the next token's step of this layer writes them only once
        # its own ids have arrived, which is after every copy queued here (one stream, in order)
        ids_host, offs_host, offs = self._host_bufs(i, both, K)
        host, arrived = self.rt.streams.to_host(self.stream, both, ids_host)
        await self.rt.ids_arrived(arrived)
        routed, guessed = host[0, :K].tolist(), host[0, K:].tolist()
        tier, landing = self.tier, self._landing()
        slots = [tier.slot_of.get((i, e)) if (i, e) not in landing else None for e in routed]  # VRAM slots, landed
        need = sorted({e for e, slot in zip(routed, slots) if slot is None})
        try:
            if nxt is not None:  # the guesses VRAM lacks; RAM's are left out by `read_guesses`
                j = self.index[nxt.layer]
                guesses = (nxt.layer, [e for e in guessed if (j, e) not in tier.slot_of])
            await self.blocks.ensure(block.layer, i, need, guesses if nxt is not None else None)
            self.token_disk += len(self.blocks.disk)
            self.token_vram += K - len(need)
            bb, ram = self.rt.store.block_bytes, self.blocks.off[i]
            offs_host.numpy()[:] = [ram[e] if slot is None else slot * bb for e, slot in zip(routed, slots)]
            with self.rt.streams.use(self.stream):
                offs.copy_(offs_host, non_blocking=True)
            return self._token(block, li.next_block, None, li.x, li.residual, routing=(weights, ids, offs), between=False)
        finally:
            self.blocks.release()

    def _router(self, block, nxt=None):
        """stream_ram: x -> (weights, ids, ids with `nxt`'s guessed ids after them) of `block`'s router (and `nxt`'s),
        replayed as a CUDA graph where graphs are on."""
        key = (block.layer, None if nxt is None else nxt.layer)
        router = self._routers.get(key)
        if router is None:
            def route(x):
                weights, ids = block.router(x)
                return weights, ids, ids if nxt is None else torch.cat((ids, nxt.router(x)[1].to(ids.dtype)), dim=1)

            router = self._routers[key] = self._graphs.wrap(route, f"router:{key}") if self._graphs is not None else route
        return router

    def _host_bufs(self, i: int, both: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MoE index i's buffers for its streamed one-token steps: pinned ids from the GPU (both's shape), the pinned
        byte offsets of its K routed blocks, and the device offsets its step reads."""
        bufs = self._host.get(i)
        if bufs is None or bufs[0].shape != both.shape:
            pin = both.device.type == "cuda"
            bufs = self._host[i] = (torch.empty(both.shape, dtype=both.dtype, pin_memory=pin),
                                    torch.empty(K, dtype=torch.int64, pin_memory=pin),
                                    torch.empty(K, dtype=torch.int64, device=both.device))
        return bufs

    def _landing(self) -> set:
        """The (MoE index, expert) of the tier's copies not yet landed: the table does not point at their slots yet."""
        landing = self.tier.landing
        if landing is None:
            return set()
        if self._landing_of is None or self._landing_of[0] is not landing:
            self._landing_of = (landing, {(m[0], m[1]) for m in landing[1]})
        return self._landing_of[1]

    def _token(self, block, next_block, layer, *args, routing: tuple | None = None, between: bool = True) -> torch.Tensor:
        """A one-token step of `block`'s layer on args (h, or x and residual: `_stepper`); `routing`: its (weights, ids,
        block offsets), routed and resolved on the host already (stream_ram), else routed in the step."""
        i = self.index[block.layer]
        if i == 0 and between:
            self._between_tokens()
        for h in (i % 2, (i + 1) % 2):  # the staging half this layer reads; the one its guesses go to (copies left unread)
            copied, self._copied[h] = self._copied[h], None
            self.rt.streams.wait(self.stream, copied)
        with self.rt.streams.use(self.stream):
            h = self._stepper(block, next_block, layer, routing is not None)(*args, *(routing or ()))
        if self.tier.S and next_block is not None:
            self._stage(i + 1)
        if self.knobs.routed:
            self.token_blocks += block.top_k
            self._kernel(block).count_groups(block.top_k)
        return h

    def _stepper(self, block, next_block, layer=None, routed: bool = False):
        """The one-token step of `block`'s layer: h [1, 1, D] -> h with `layer` (its MoE input included), else
        (x [1, D], residual) -> h, or with `routed` (x, residual, weights, ids, offs: the routed blocks' byte offsets,
        found by the host) -> h; replayed as a CUDA graph with `graphs`."""
        fn = self._steppers.get((block.layer, layer is None, routed))
        if fn is None:
            kern, i, K, E = self._kernel(block), self.index[block.layer], block.top_k, self.rt.store.manifest.num_experts
            zero_skip, base, skip, bb = self.knobs.zero_skip, self.base, not self.knobs.routed, self.rt.store.block_bytes
            # with a VRAM tier the bank is VRAM and the blocks outside it are read from pinned RAM over PCIe
            tier = self.tier
            host = True if self.knobs.host_hint and tier.vram is not None else None
            j = i + 1  # the next MoE layer (next_block), whose guesses this step makes when the staging bank is on
            nxt = next_block if tier.S else None
            shared = block.shared if self.knobs.shared == "side" else None
            side = self._side if shared is not None or nxt is not None else None
            stage0 = tier.staging_offset(i % 2)

            ones = torch.ones(K, dtype=torch.int64, device=self.base.device)

            def routed_sum(x, weights, ids, xe, offs=None):
                if skip:  # the resident part alone: no expert kernels, a zero routed sum of the experts' output width
                    return torch.zeros_like(xe)
                if offs is not None:  # resolved by the host (stream_ram); the uses that the tier's refreshes rank by
                    tier.uses[i].index_add_(0, ids[0].long(), ones)
                else:
                    offs = resolve(ids[0], tier.table[i], tier.in_vram[i], self._held[i % 2], stage0, bb, i * E,
                                   torch.empty(K, dtype=torch.int64, device=x.device), tier.uses[i], self.vram_served,
                                   self.staged_served)
                y = kern._decode(base, offs, base, offs, xe[0], weights[0], block.combine_dtype, zero_skip, host)  # [K, Dx], row k
                return y.view(1, K, -1).sum(dim=1).to(x.dtype)

            def beside(x):
                """The next layer's guesses that VRAM lacks, then the shared term (None without)."""
                if nxt is not None:
                    select(nxt.router(x)[1][0], tier.in_vram[j], tier.table[j], j * E, self._guess_ids[j % 2],
                           self._guess_src[j % 2], self.staged_copies)
                return shared(x) if shared is not None else None

            def experts(x, residual, *routing):
                if side is None:  # a CPU: in line
                    s = beside(x)
                    weights, ids, offs = routing or (*block.router(x), None)
                    return residual + block.output(routed_sum(x, weights, ids, block.expert_input(x), offs), x, s).view_as(residual)
                main = torch.cuda.current_stream()
                side.wait_stream(main)  # beside the router and the routed experts
                with torch.cuda.stream(side):
                    s = beside(x)
                weights, ids, offs = routing or (*block.router(x), None)
                routed_out = routed_sum(x, weights, ids, block.expert_input(x), offs)
                main.wait_stream(side)
                if s is not None and not torch.cuda.is_current_stream_capturing():  # eager: not reused before main reads it
                    s.record_stream(main)
                return residual + block.output(routed_out, x, s).view_as(residual)

            step = experts if layer is None else lambda h: experts(*layer.moe_input(h, None))
            name = f"direct{'' if layer is None else '+input'}{'+ids' if routed else ''}:{block.layer}"
            # a graph only where the model says its router, expert input and finish are pure (MoEBlock.graph_safe); the
            # others run the same step eagerly, still without a host wait
            graphed = self._graphs is not None and block.graph_safe
            fn = self._steppers[(block.layer, layer is None, routed)] = self._graphs.wrap(step, name) if graphed else step
        return fn

    def _stage(self, j: int) -> None:
        """Copy MoE layer j's guessed blocks (chosen by the step just queued) into staging half j % 2, on the
        staging stream after that step; layer j's step waits for them (`_token`)."""
        h, bb = j % 2, self.rt.store.block_bytes
        stream = self._ahead_stream
        if stream is not None:
            stream.wait_event(self.rt.streams.record(self.stream))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            stage_copy(self.base, self._guess_ids[h], self._guess_src[h], self.tier.staging_offset(h), bb)
            self._held[h].copy_(self._guess_ids[h])
        if stream is not None:
            self._copied[h] = torch.cuda.Event()
            self._copied[h].record(stream)

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
