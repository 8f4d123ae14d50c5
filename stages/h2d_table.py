"""h2d, `via: table`: blocks cross PCIe where they are read (zero-copy), or are copied into VRAM ahead of their layer.

A one-token step's kernels read the blocks VRAM lacks from pinned RAM themselves. With `token_ahead` N, the next
MoE layer's guessed blocks (predict's list, chosen in the step just queued) are copied into a staging half of N of
the tier's slots, on a stream of their own, while the resident layers before that layer run: that layer's step waits
for them and reads them there. Prompts copy RAM blocks into VRAM `prompt_group` at a time (`plan`, `copied`), into
free tier slots first (`prompt_fill`), and copy the next layer's guessed blocks ahead (`prompt_ahead`: `look_ahead`).
With `prompt_cpu` a prompt's RAM blocks of few rows cross no bus: the CPU computes them from their RAM slots while
PCIe carries the others (compute's `beside_cpu`), so that the host's RAM reads add to PCIe's, as llama.cpp's CPU
layers do; the blocks the next layer's guesses leave to the CPU are not copied ahead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from sluice.errors import ScheduleError
from sluice.kernels.ahead import stage_copy
from sluice.stages.base import Stage


@dataclass(frozen=True)
class H2DTableKnobs:
    token_ahead: int = 8  # one-token steps: of the next MoE layer's guessed experts (predict's), the first this many
    # whose blocks VRAM lacks are copied from RAM into a staging bank of the tier's slots (two halves, by the layer's
    # parity) on a stream of their own, under the resident layers before that layer, which then reads them there
    # instead of over PCIe; 0: off (blocks outside VRAM read in place)
    prompt_group: int = 8  # prompts: RAM blocks copied to VRAM this many at a time, double-buffered (0: read in place)
    prompt_fill: bool = True  # prompts: a RAM block copied while the VRAM tier has a free slot is copied into the slot and stays
    prompt_ahead: int = 128  # prompts: the next MoE layer's blocks, guessed by its router on this layer's input, copied
    # while this layer computes: into free tier slots (as many as are free), then up to this many into a bank of
    # 2 x this many of the tier's slots (at most half of them), which one-token steps take back into the tier with the
    # blocks in it; 0: off. 128, a whole layer of 128 experts: its copies queue before the host's work between layers,
    # and Nano's prompts at 8 GiB ran faster than with 32 (BENCHMARKS.md, seventeenth set)
    prompt_cpu: int = 0  # prompts: RAM blocks routed to at most this many of the step's rows are computed by the CPU
    # from their RAM slots while the others cross PCIe, and not copied ahead; -1: the count from the measured rates
    # that finishes both soonest, layer by layer (`balance_prompt_cpu`; none until a GPU's rates are measured); 0: off

    def __post_init__(self):
        if self.prompt_ahead < 0:
            raise ScheduleError(f"stage 'h2d': 'prompt_ahead' must be >= 0, got {self.prompt_ahead!r}")
        if self.prompt_cpu < -1:
            raise ScheduleError(f"stage 'h2d': 'prompt_cpu' must be -1 (from the rates), 0 (off) or a row count, "
                                f"got {self.prompt_cpu!r}")


class H2DTable(Stage):
    name = "h2d"
    via = "table"
    consumes = ("layer", "blocks", "routing")
    produces = "device_blocks"
    Knobs = H2DTableKnobs

    def before(self, t, first: bool) -> None:
        """The step waits for the staging half it reads; the half its guesses go to is free once their copies land."""
        table, i = self.table, t.i
        for h in (i % 2, (i + 1) % 2):
            copied, table.copied[h] = table.copied[h], None
            self.rt.streams.wait(table.stream, copied)

    def after(self, t) -> None:
        """Copy the next layer's guessed blocks (chosen by the step just queued) into staging half (i + 1) % 2, on the
        staging stream after that step; the next layer's step waits for them (`before`)."""
        table = self.table
        if not table.tier.S or t.nxt is None or t.rows > 1:
            return
        h, stream = (t.i + 1) % 2, table.ahead_stream
        if stream is not None:
            stream.wait_event(self.rt.streams.record(table.stream))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            stage_copy(table.base, table.guess_ids[h], table.guess_src[h], table.tier.staging_offset(h), table.block_bytes)
            table.held[h].copy_(table.guess_ids[h])
        if stream is not None:
            table.copied[h] = torch.cuda.Event()
            table.copied[h].record(stream)

    # -- a step whose ids come to the host (a prompt) ---------------------------------------------------------------

    def plan(self, v: dict) -> None:
        """Where each RAM block of the step is read: by the CPU where a prompt gives it few rows (`prompt_cpu`: `cpu`),
        else copied `prompt_group` at a time into a free tier slot (where `prompt_fill` finds one; it stays there) or a
        staging bank (double-buffered), or in place (`prompt_group: 0`); every block's offset sent to the GPU in one
        copy (`offs`); the (token, k) rows sorted into the order compute takes the blocks once, so that each group's
        rows are one slice, the CPU's last (`cpu_pairs`: their flat rows, block by block)."""
        table, i = self.table, v["i"]
        tier, G, bb, offsets = table.tier, self.knobs.prompt_group, table.block_bytes, v["offsets"]
        counts = v["counts"]
        limit = 0 if v["li"].decode else \
            self._cpu_limit(i, [counts[e] for e in v["in_ram"]], v["li"].block, v["xe"].shape[1])  # prompts only
        cpu = [e for e in v["in_ram"] if counts[e] <= limit]
        in_ram = v["in_ram"] = [e for e in v["in_ram"] if counts[e] > limit]
        rank = np.zeros(table.num_experts, dtype=np.int64)
        rank[v["in_vram"] + v["ahead"] + in_ram + cpu] = np.arange(len(v["experts"]))
        order = np.argsort(rank[v["flat"]], kind="stable")
        v.update(cpu=cpu, cpu_pairs=order[len(order) - sum(counts[e] for e in cpu):],
                 rows=torch.from_numpy(order).to(v["xe"].device, non_blocking=True))
        groups = [in_ram[s : s + G] for s in range(0, len(in_ram), G)] if G else [in_ram] if in_ram else []
        if G and in_ram and table.staging is None:
            table.staging = torch.empty(2 * G * bb, dtype=torch.uint8, device=self.rt.device)
        copies, filled = [], []  # per RAM group [(expert, destination)]; (i, e, slot) copied into free VRAM tier slots
        v["filled"] = filled
        for g, group in enumerate(groups):
            dsts = []
            for j, e in enumerate(group):
                if not G:
                    offsets.append(table.blocks.off[i][e])
                    continue
                if self.knobs.prompt_fill and tier.free:  # a free slot is read by no kernel: the copy needs no wait
                    slot = tier.slot_of[(i, e)] = tier.free.pop()
                    filled.append((i, e, slot))
                    dst = tier.vram.arena.slot(slot)
                else:
                    dst = table.staging[((g % 2) * G + j) * bb : ((g % 2) * G + j + 1) * bb]
                dsts.append((e, dst))
                offsets.append(dst.data_ptr() - table.base.data_ptr())
            copies.append(dsts)
        v.update(groups=groups, copies=copies, at=[0, 0, 0],  # experts, rows and groups computed so far
                 offs=torch.tensor(offsets, dtype=torch.int64).to(v["xe"].device, non_blocking=True))

    def copied(self, v: dict):
        """The step's RAM groups, each yielded once its copies are queued on the copy stream and the step's stream
        waits for them; a staging half is copied into again once the compute that read it is queued."""
        table, streams, layer = self.table, self.rt.streams, v["li"].block.layer
        if not self.knobs.prompt_group:
            yield from v["groups"]  # read in place
            return
        for g, (group, dsts) in enumerate(zip(v["groups"], v["copies"])):
            half = g % 2
            with streams.use("copy"):
                streams.wait("copy", table.staged[half])
                copy_blocks([(dst, table.blocks.entries[(layer, e)].buf) for e, dst in dsts], table.block_bytes)
                landed = streams.record("copy")
            streams.wait(table.stream, landed)
            yield group
            table.staged[half] = streams.record(table.stream)

    def landed(self, v: dict) -> None:
        """The step's kernels are queued: the lookahead bank's half they read is marked read, the tier slots filled are
        pointed at (the table switches to them once their copies have landed, in stream order)."""
        table = self.table
        if v["early"]:
            table.tier.ahead_read[v["i"] % 2] = self.rt.streams.record(table.stream)
        self.rt.stats.vram_fills += len(v["filled"])
        table.tier.point(v["filled"], vram=True)

    def look_ahead(self, v: dict) -> None:
        """Copy the next MoE layer's blocks that its router, run on this layer's input, chose for the step's tokens
        (`guess`, most chosen first), behind the copies already queued: into free VRAM tier slots, else into the
        lookahead bank's half for its parity (once the compute that last read it is done). That layer reads them from
        there once they land; a guess it did not route to was a wasted copy. The bank's blocks join the hot set when
        one-token steps take the bank back (storage/vram_tier.py `lend_bank`)."""
        table, guess = self.table, v["guess"]
        if guess is None:
            return
        i = table.index[v["li"].next_block.layer]
        tier = table.tier
        counts = np.bincount(guess.numpy().reshape(-1).astype(np.int64), minlength=table.num_experts)  # host work in numpy
        order = np.argsort(-counts, kind="stable")[: int((counts > 0).sum())].tolist()  # most chosen first, ties by id
        bank = iter(tier.ahead_bank[i % 2])
        early, filled, moves = {}, [], []
        layer = table.layers[i]
        outside = [e for e in order if (i, e) not in tier.slot_of]
        limit = 0
        if outside and not v["li"].decode:  # else that layer's plan chooses over the blocks it finds outside
            limit = self._cpu_limit(i, [int(counts[e]) for e in outside], v["li"].next_block, v["xe"].shape[1], fresh=True)
            table.cpu_ahead = (i, limit)  # that layer's plan keeps it (the blocks left to copy then are few)
        free = len(tier.free) if self.knobs.prompt_fill else 0
        picks = []  # (expert, its RAM entry), most chosen first, as many as the free slots and the bank's half take
        for e in outside:
            if len(picks) == free + len(tier.ahead_bank[i % 2]):
                break
            if counts[e] > limit and (src := table.blocks.resident(layer, e)) is not None:  # not the CPU's, in RAM
                picks.append((e, src))
        # the most chosen take the free slots (they stay in the hot set), the others the bank's; each part in expert
        # order, so that blocks adjacent in RAM go to adjacent slots as one copy (copy_blocks): a copy a block was ~2600
        # calls a 512-token prompt, copy_blocks 0.23 s of the host's 0.85 over two (nineteenth set's profile)
        taken = min(free, len(picks))
        for into_free, part in ((True, picks[:taken]), (False, picks[taken:])):
            for e, src in sorted(part, key=lambda pick: pick[0]):
                if into_free:
                    slot = tier.slot_of[(i, e)] = tier.free.pop()
                    filled.append((i, e, slot))
                else:
                    slot = next(bank)
                early[e] = slot * table.block_bytes
                moves.append((e, slot, src))
        if not moves:
            return
        streams = self.rt.streams
        try:
            with streams.use("copy"):
                streams.wait("copy", tier.ahead_read[i % 2])
                copy_blocks([(tier.vram.arena.slot(slot), src.buf) for _, slot, src in moves], table.block_bytes)
                landed = streams.record("copy")
            tier.read_by([src for _, _, src in moves], landed)
            tier.bank_copied([(i, e, slot) for e, slot, _ in moves if (i, e) not in tier.slot_of], landed)
        except BaseException:
            table.unfill(filled)
            raise
        self.rt.stats.vram_prefetches += len(moves)
        table.ahead = (i, early, landed, filled)

    def _cpu_limit(self, i: int, counts: list[int], block, dx: int, fresh: bool = False) -> int:
        """Most rows a block outside VRAM of MoE index i's prompt step may have for the CPU to compute it: `prompt_cpu`,
        or with -1 the balance over `counts` (the rows of the layer's blocks outside VRAM) by the measured rates, as the
        layer before chose it when it copied this one's blocks ahead, unless `fresh` (choosing it for those copies)."""
        k, table = self.knobs.prompt_cpu, self.table
        if k >= 0:
            return k
        if not fresh:
            chosen, table.cpu_ahead = table.cpu_ahead, None
            if chosen is not None and chosen[0] == i:
                return chosen[1]
        rates = table.prompt_rates(block, dx) if counts else None
        return balance_prompt_cpu(counts, table.copy_s(), *rates) if rates else 0


def balance_prompt_cpu(counts: list[int], tg: float, tc: float, call: float = 0.0, next_row: float | None = None) -> int:
    """Of a prompt layer's blocks outside VRAM, with `counts` rows each, the most rows a block may have for the CPU to
    compute it (tc seconds a block's first row, `next_row` each further row (None: tc), `call` a call, one block after
    another) rather than copy it (tg seconds a block, one after another, beside the CPU): the count that finishes both
    soonest, the lower on a tie; 0 where the CPU would finish after the copies of every block."""
    cs, tn = sorted(counts), tc if next_row is None else next_row
    best, best_t, rows = 0, len(cs) * tg, 0
    for j, c in enumerate(cs):
        rows += c
        if j + 1 < len(cs) and cs[j + 1] == c:  # a count takes every block of that count
            continue
        t = max(call + (j + 1) * tc + (rows - j - 1) * tn, (len(cs) - j - 1) * tg)
        if t < best_t - 1e-12:
            best, best_t = c, t
    return best


def copy_blocks(pairs: list[tuple[torch.Tensor, torch.Tensor]], block_bytes: int) -> None:
    """(destination, source) blocks copied on the current stream, blocks adjacent at both ends as one copy (a layer's RAM
    blocks lie in expert order, a group's staging slots in a row): fewer calls for the host."""
    ptrs = [(dst.data_ptr(), src.data_ptr()) for dst, src in pairs]  # read once: each call costs the host
    k = 0
    while k < len(pairs):
        n = 1
        raw = pairs[k][0].dtype == pairs[k][1].dtype == torch.uint8  # sizes in bytes
        while (raw and k + n < len(pairs)
               and ptrs[k + n][0] == ptrs[k][0] + n * block_bytes and ptrs[k + n][1] == ptrs[k][1] + n * block_bytes
               and all(_storage(pairs[k + n][x]) == _storage(pairs[k][x]) for x in (0, 1))):
            n += 1
        dst, src = pairs[k]
        if n == 1:
            dst.copy_(src, non_blocking=True)
        else:  # views over the run, within each block's storage (one arena)
            dst.as_strided((n * block_bytes,), (1,)).copy_(src.as_strided((n * block_bytes,), (1,)), non_blocking=True)
        k += n


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
