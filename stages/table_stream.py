"""The device table's one-token steps over a RAM cache (fetch's `hold: false`): the host routes, reads, then the step.

The routed ids come to the host first (one wait per MoE layer; with `prefetch`, the next MoE layer's guesses with
them), which reads the blocks neither the VRAM tier nor RAM holds from disk and sends the plan's composed step
(pipeline/plan.py) the offsets it found the blocks at, as routing it need not make (`TokenLayer.hosted`).

`StreamedSteps` is a part of `Table` (a mixin): it uses the table's rt, knobs, stream, index, tier, blocks, graphs and
its `step` (the plan's).
"""

from __future__ import annotations

import torch

from sluice.stages.types import LayerInput


class StreamedSteps:
    async def _token_streamed(self, li: LayerInput, i: int) -> torch.Tensor:
        """stream_ram, a one-token step: the router's ids come to the host (the one wait; with `prefetch`, the next MoE
        layer's guesses with them, and with `depth` > 1 those of the layers after it, read behind the demands, nearest
        layer first), the routed blocks the VRAM tier does not serve are brought into RAM (demand reads from disk for
        the misses) and pinned; then the layer's step runs as `direct`'s does, on these ids and on the offsets the host
        found them at (the blocks checked are the blocks read), sent with one copy instead of pointing the table at them
        (`VramTier.point`: several launches a layer)."""
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
                self.record(block.layer, i, routed, sorted(set(routed)), set(routed) - set(need), further)
                if guesses:
                    self._guessed[guesses[0][0]] = tuple(guesses[0][1])
            bb, ram = self.rt.store.block_bytes, self.blocks.off[i]
            offs_host.numpy()[:] = [ram[e] if slot is None else slot * bb for e, slot in zip(routed, slots)]
            with self.rt.streams.use(self.stream):
                offs.copy_(offs_host, non_blocking=True)
            h = self.step(block, li.next_block, None, (li.x, li.residual), routing=(weights, ids, offs), first=False)
            self.token_disk += len(self.blocks.disk)  # counted with the step's blocks (compute's `after`), once it is queued
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

            graphed = self.graphs is not None and all(b.graph_safe for b in ahead)
            router = self._routers[key] = self.graphs.wrap(route, f"router:{key}") if graphed else route
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
