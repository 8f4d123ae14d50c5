"""The device table's prompts (T > 1): the grouped GEMM over the blocks wherever they lie (stages/table.py).

The ids come to the host (one wait per layer); the grouped GEMM reads the blocks in VRAM from their slots, and the
rest after the copy stream has brought them, `prompt_group` at a time, into a small staging bank (double-buffered, so
a group's copies run under the previous group's GEMMs). While the VRAM tier has free slots (`prompt_fill`), a block is
copied into a slot instead and stays there: the copy is paid for anyway, and the next prompt, or the first decode
steps, find it in VRAM. With `prompt_ahead`, the next MoE layer's blocks that its router picks on this layer's input
are copied ahead, while this layer computes.

`PromptSteps` is a part of `Table` (a mixin): it uses the table's rt, knobs, stream, tier, blocks, base, layers and
`kernel`, and keeps the prompts' own state in `_staging`, `_staged` and `_ahead` (set up in `Table.__init__`).
"""

from __future__ import annotations

import torch


class PromptSteps:
    def _prompt_experts(self, block, i, flat, experts, xe, w, y) -> None:
        """A prompt's experts (flat: its routed ids [T*K], CPU): those in VRAM from their slots; those the previous layer
        copied ahead (`prompt_ahead`) once their copies land; those in RAM (with `prompt_group`) copied into a staging
        bank group by group on the copy stream, each group computed once its copies land while the next is copied (the
        copy engine moves them faster than a GEMM reading host memory row tile by row tile); else in place. The host's
        work per layer is one sort of the (token, k) positions into the groups' order, so that each group's rows are one
        slice, and one copy of every group's block offsets."""
        kern, K, bb, streams = self.kernel(block), block.top_k, self.rt.store.block_bytes, self.rt.streams
        tier = self.tier
        G, E = self.knobs.prompt_group, tier.table.shape[1]
        if self._ahead is not None and self._ahead[0] != i:  # copied for a step that did not come (an error): keep the slots
            self._settle_ahead()
        early = self._copied_ahead(i)
        in_vram = [e for e in experts if (i, e) in tier.slot_of and e not in early]
        ahead = [e for e in experts if e in early]
        in_ram = [e for e in experts if (i, e) not in tier.slot_of and e not in early]
        for e in experts:  # a block copied ahead is read from VRAM (its copy is counted as a guess copied, once)
            self.rt.stats.tier("vram" if e in in_vram or e in early else "disk" if e in self.blocks.disk else "ram")
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

    def _copied_ahead(self, i: int) -> dict[int, int]:
        """MoE index i's blocks that the layer before copied ahead (`_look_ahead`): expert -> offset of its copy."""
        return self._ahead[1] if self._ahead is not None and self._ahead[0] == i else {}

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
