"""The direct stage's one-token steps: a MoE layer's whole step as one CUDA graph (stages/direct.py).

A step routes on the GPU, resolves the K routed ids to their blocks' offsets (a VRAM tier slot, a staging slot, else
the pinned RAM slot, which the kernels read over PCIe), runs the layer's expert kernels on them, sums the K weighted
outputs in combine's fixed order and finishes the layer: one graph per layer (for models whose MoE functions are pure:
`MoEBlock.graph_safe`; others run the same step eagerly), so the host queues a whole decode step without a wait.

One-token lookahead (`token_ahead`, with a VRAM tier): each step also runs the next MoE layer's router on its input
(on a side stream, with the shared expert: `shared`), and of those guesses, the first S whose blocks the tier lacks are
copied from RAM into half of a staging bank of tier slots (kernels/ahead.py: ids chosen and copied on the GPU, the
host never sees them) on a stream of their own, after the step: under the resident layers before the next MoE layer.
That layer waits for the copies, then resolves each routed id to the tier's slot, else a staging slot holding that
block, else its RAM slot. Blocks are bytes that never change, so a slot is read only once its copy has landed and the
result is the same wherever a block is read from.

`hold: false` (stream_ram): the ids come to the host first (`_token_streamed`), which reads the misses from disk and
sends the same step the offsets it found the blocks at.

`TokenSteps` is a part of `Direct` (a mixin): it uses the stage's rt, knobs, stream, index, tier, blocks, base and
`_kernel`, and the one-token state set up in `Direct.__init__` (graphs, streams, staging tensors, counters).
"""

from __future__ import annotations

import contextlib

import torch

from sluice.kernels.ahead import resolve, select, stage_copy
from sluice.stages.types import LayerInput


class TokenSteps:
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
        layer's guesses with them, and with `depth` > 1 those of the layers after it, read behind the demands, nearest
        layer first), the routed blocks the VRAM tier does not serve are brought into RAM (demand reads from disk for
        the misses) and pinned; then the layer's step runs as `direct`'s does, on these ids and on the offsets the host
        found them at (the blocks checked are the blocks read), sent with one copy instead of pointing the table at them
        (`Tier.point`: several launches a layer)."""
        block, K = li.block, li.block.top_k
        ahead = (li.next_block, *li.ahead) if self.knobs.prefetch and li.next_block is not None else ()  # guessed layers
        tracer = self.rt.tracer
        with tracer.span("route", layer=block.layer, stream=self.stream):
            with self.rt.streams.use(self.stream):
                weights, ids, both = self._router(block, ahead)(li.x)
            # per MoE layer, pinned buffers this step alone uses: the next token's step of this layer writes them only
            # once its own ids have arrived, which is after every copy queued here (one stream, in order)
            offs_host, offs = self._offsets(i, K)
            host, arrived = self.rt.streams.to_host(self.stream, both, reuse=("direct ids", i))
            await self.rt.ids_arrived(arrived)
        row = host[0].tolist()
        extra = self.knobs.guess_extra if ahead else 0  # the next layer's guesses past its top-k, after its top-k
        routed, guessed = row[:K], [row[K * (n + 1) + (extra if n else 0) : K * (n + 2) + extra] for n in range(len(ahead))]
        stats = self.rt.stats  # the guesses' recall, as the predict stage counts it: those made for this layer, then its own
        stats.observe_routing(block.layer, tuple(routed))
        for n, (b, g) in enumerate(zip(ahead, guessed)):
            stats.observe_prediction(b.layer, tuple(g[:K]), ahead=n + 1)
        tier, landing = self.tier, self._landing()
        slots = [tier.slot_of.get((i, e)) if (i, e) not in landing else None for e in routed]  # VRAM slots, landed
        need = sorted({e for e, slot in zip(routed, slots) if slot is None})
        # the guesses VRAM lacks, nearest layer first, the next layer's past its top-k last; RAM's are left out by
        # `read_guesses`
        lacks = lambda b, g: (b.layer, [e for e in g if (self.index[b.layer], e) not in tier.slot_of])  # noqa: E731
        guesses = [lacks(b, g[:K]) for b, g in zip(ahead, guessed)] + ([lacks(ahead[0], guessed[0][K:])] if extra else [])
        try:
            with tracer.span("fetch", layer=block.layer, stream=self.stream):
                await self.blocks.ensure(block.layer, i, need, guesses)
            if self.rt.recorder is not None:
                further = tuple((layer, tuple(g)) for layer, g in guesses[1 : len(ahead)])
                self._record(block.layer, i, routed, sorted(set(routed)), set(routed) - set(need), further)
                if guesses:
                    self._guessed[guesses[0][0]] = tuple(guesses[0][1])
            bb, ram = self.rt.store.block_bytes, self.blocks.off[i]
            offs_host.numpy()[:] = [ram[e] if slot is None else slot * bb for e, slot in zip(routed, slots)]
            with self.rt.streams.use(self.stream):
                offs.copy_(offs_host, non_blocking=True)
            h = self._token(block, li.next_block, None, li.x, li.residual, routing=(weights, ids, offs), between=False)
            self.token_disk += len(self.blocks.disk)  # counted with the step's blocks (`_token`), once it is queued
            self.token_vram += K - len(need)
            return h
        finally:
            self.blocks.release()

    def _router(self, block, ahead=()):
        """stream_ram: x -> (weights, ids, ids with the guessed ids of the MoE layers `ahead` after them) of `block`'s
        router (and theirs, on the same input; the nearest's top-k and `guess_extra` more, as it ranks them), replayed
        as a CUDA graph where graphs are on (and those routers are pure too: a guess from a stale capture would only
        read the wrong blocks, but reads are what a cold step waits for)."""
        key = (block.layer, tuple(b.layer for b in ahead))
        router = self._routers.get(key)
        if router is None:
            extra = self.knobs.guess_extra

            def route(x):
                weights, ids = block.router(x)
                if not ahead:
                    return weights, ids, ids
                guesses = (ahead[0].ranked(x, block.top_k + extra) if extra else ahead[0].guessed(x)[1],
                           *(b.guessed(x)[1] for b in ahead[1:]))
                return weights, ids, torch.cat((ids, *(g.to(ids.dtype) for g in guesses)), dim=1)

            graphed = self._graphs is not None and all(b.graph_safe for b in ahead)
            router = self._routers[key] = self._graphs.wrap(route, f"router:{key}") if graphed else route
        return router

    def _offsets(self, i: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE index i's block offsets for its streamed one-token steps: host (`Streams.host_buffer`: pinned, reused)
        and device (what the step reads)."""
        offs = self._offs.get(i)
        if offs is None or offs.shape[0] != K:
            offs = self._offs[i] = torch.empty(K, dtype=torch.int64, device=self.rt.device)
        return self.rt.streams.host_buffer(("direct offsets", i), torch.Size([K]), torch.int64), offs

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
        replays = self._graphs.replays if self._graphs is not None else 0
        with self.rt.streams.use(self.stream):
            h = self._stepper(block, next_block, layer, routing is not None)(*args, *(routing or ()))
        if self._graphs is not None and self._graphs.replays > replays:  # a replay: its parts' spans, read at flush
            self.rt.tracer.replayed(self._marks[(block.layer, layer is None, routing is not None)])
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

            ones = torch.ones(K, dtype=torch.int64, device=tier.uses.device)  # base may be the pinned RAM arena
            # with a trace, each part times itself under its stage's name (GPU spans recorded by the graph itself)
            marks = self._marks[(block.layer, layer is None, routed)] = []
            tracer, untimed = self.rt.tracer, contextlib.nullcontext()
            part = (lambda name: tracer.phase(name, block.layer, self.stream, marks)) if tracer.enabled else \
                (lambda name: untimed)  # noqa: E731

            def routed_sum(x, weights, ids, xe, offs=None):
                if skip:  # the resident part alone: no expert kernels, a zero routed sum of the experts' output width
                    return torch.zeros_like(xe)
                with part("fetch"):  # each routed id to its block: a VRAM slot, a staging slot, else its RAM slot
                    if offs is not None:  # resolved by the host (stream_ram); the uses that the tier's refreshes rank by
                        tier.uses[i].index_add_(0, ids[0].long(), ones)
                    else:
                        offs = resolve(ids[0], tier.table[i], tier.in_vram[i], self._held[i % 2], stage0, bb, i * E,
                                       torch.empty(K, dtype=torch.int64, device=x.device), tier.uses[i], self.vram_served,
                                       self.staged_served)
                with part("compute"):  # and the fixed-order sum over the top-k
                    y = kern._decode(base, offs, base, offs, xe[0], weights[0], block.combine_dtype, zero_skip, host)  # [K, Dx], row k
                    return y.view(1, K, -1).sum(dim=1).to(x.dtype)

            def beside(x):
                """The next layer's guesses that VRAM lacks, then the shared term (None without)."""
                if nxt is not None:
                    with part("predict"):
                        select(nxt.guessed(x)[1][0], tier.in_vram[j], tier.table[j], j * E, self._guess_ids[j % 2],
                               self._guess_src[j % 2], self.staged_copies)
                if shared is None:
                    return None
                with part("route"):  # the shared expert runs beside the router, as route's `shared: early` does
                    return shared(x)

            def routes(x, routing):
                """((weights, ids, offs or None) of the router on x, or as the host routed them (stream_ram); the
                experts' input)."""
                if routing:
                    return routing, block.expert_input(x)
                with part("route"):
                    return (*block.router(x), None), block.expert_input(x)

            def experts(x, residual, *routing):
                if marks and torch.cuda.is_current_stream_capturing():
                    marks.clear()  # a new capture records its own parts
                if side is None:  # a CPU: in line
                    s = beside(x)
                    (weights, ids, offs), xe = routes(x, routing)
                    routed_out = routed_sum(x, weights, ids, xe, offs)
                    with part("combine"):
                        return residual + block.output(routed_out, x, s).view_as(residual)
                main = torch.cuda.current_stream()
                side.wait_stream(main)  # beside the router and the routed experts
                with torch.cuda.stream(side):
                    s = beside(x)
                (weights, ids, offs), xe = routes(x, routing)
                routed_out = routed_sum(x, weights, ids, xe, offs)
                main.wait_stream(side)
                if s is not None and not torch.cuda.is_current_stream_capturing():  # eager: not reused before main reads it
                    s.record_stream(main)
                with part("combine"):
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
