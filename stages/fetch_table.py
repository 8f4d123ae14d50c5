"""fetch, `via: table`: each routed expert to the byte offset its kernels read it at, through a device table.

Every block is held in pinned RAM (`hold: true`); the table (storage/vram_tier.py) points each (MoE layer, expert)
at its VRAM tier slot or its RAM slot, and a one-token step resolves its routed ids on the GPU (kernels/ahead.py
`resolve`: a staged guess's slot wins over RAM), counting the uses the tier's refreshes rank by. With `hold: false`
RAM is an LRU cache filled from disk: the table's host side brings each step's ids to the host, reads what neither
tier holds and sends the offsets it found (`TokenLayer.hosted`); the step then only counts the uses. The tier's turn
comes before a token's first MoE layer (its copies landed, its counts read every `refresh` tokens); the new hot set is
chosen once the token's MoE layers are queued (`token_queued`), its host work beside the GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.errors import ScheduleError
from sluice.kernels.ahead import resolve
from sluice.stages.base import Stage


@dataclass(frozen=True)
class FetchTableKnobs:
    vram: bool = True  # keep the most routed blocks in the VRAM tier's slots
    refresh: int = 16  # one-token steps between VRAM tier updates
    decay: float = 0.5  # weight of older counts at each update (0: only the last `refresh` steps count)
    margin: float = 1.0  # a block replaces a VRAM one only when its decayed count beats that one's by more than this
    noise: float = 1.5  # ... and by this many times the counts' noise, sqrt of the two counts (Poisson): under uniform
    # routing counts differ by chance alone, and swaps on them copied ~8% of a token's PCIe bytes (BENCHMARKS.md)
    vram_fill: bool = True  # at open (and when emptied) the tier's free slots take blocks spread evenly over the MoE
    # layers, so that a first prompt finds it as full as a later one does (needs hold: true); false: empty until prompts
    # and refreshes fill it
    hold: bool = True  # every block read into pinned RAM at open and held; false: RAM is an LRU cache filled from disk
    prefetch: bool = True  # hold: false: one-token steps also read the next MoE layer's guessed blocks (its router on
    # this layer's input) that neither tier holds from disk, as guesses (only while no demand read is queued or running)
    depth: int = 1  # hold: false, prefetch: MoE layers guessed ahead (their routers on this layer's input): 1 is the next
    # one; more add the layers after it, read behind the nearer layers' guesses (as predict's knob)
    guess_extra: int = 0  # hold: false, prefetch: the next MoE layer's guesses go this many experts past its top-k (its
    # router's ranking on this layer's input), read after every other guess; needs a router that ranks
    # (MoEBlock.ranked: NemotronH); a routing trace records the top-k guesses only, so `sluice simulate` leaves these out
    readers: int = 8  # reader threads (one pool for the engine; hold: true reads every block at open)
    guess_reads: int = 2  # hold: false: guesses read at once, at most (fewer than `readers`, so that a demand read finds
    # a thread; with read_pieces > 1, pieces of guesses)
    read_pieces: int = 1  # a block read as this many parts at once by the pool's threads, in the order asked for

    def __post_init__(self):
        for knob in ("depth", "readers", "guess_reads", "read_pieces", "refresh"):
            if getattr(self, knob) < 1:
                raise ScheduleError(f"stage 'fetch': {knob!r} must be >= 1, got {getattr(self, knob)!r}")
        if not 0.0 <= self.decay <= 1.0:
            raise ScheduleError(f"stage 'fetch': 'decay' must be in [0, 1], got {self.decay!r}")
        for knob in ("margin", "noise"):
            if getattr(self, knob) < 0:
                raise ScheduleError(f"stage 'fetch': {knob!r} must be >= 0, got {getattr(self, knob)!r}")
        for knob, default, what in (("depth", 1, "guesses layers ahead"), ("guess_extra", 0, "guesses past the top-k")):
            if getattr(self, knob) > default and (self.hold or not self.prefetch):
                raise ScheduleError(f"stage 'fetch': {knob!r} {getattr(self, knob)} {what} for reads from disk: it needs "
                                    f"hold: false and prefetch: true")


class FetchTable(Stage):
    name = "fetch"
    via = "table"
    consumes = ("layer", "routing")
    produces = "blocks"
    Knobs = FetchTableKnobs

    @classmethod
    def needs(cls, k: FetchTableKnobs) -> dict:
        return {"readers": k.readers, "guess_reads": k.guess_reads, "read_pieces": k.read_pieces,
                "ram": "all" if k.hold else "cache", "depth": k.depth, "guess_extra": k.guess_extra, "table": True}

    def launch(self, t):
        table, part, i, K = self.table, t.part, t.i, t.block.top_k
        if not table.knobs.routed:
            return None
        tier, gid0, bb = table.tier, i * table.num_experts, table.block_bytes
        if t.hosted:  # the host found the offsets; the uses that the tier's refreshes rank by
            ones = torch.ones(K, dtype=torch.int64, device=tier.uses.device)

            def count(v):
                with part("fetch"):
                    tier.uses[i].index_add_(0, v["ids"][0].long(), ones)
            return count

        if t.rows > 1:  # a batched step's rows: every expert's block where the table says, read once for them all
            def rows(v):
                with part("fetch"):
                    flat = v["ids"].reshape(-1)
                    per_expert = v["per_expert"] = torch.zeros_like(tier.uses[i]).index_add_(0, flat, torch.ones_like(flat))
                    tier.uses[i].add_(per_expert)
                    chosen = per_expert.clamp(max=1)  # the rows' union of experts
                    table.rows_blocks.add_(chosen.sum())
                    table.vram_served.add_((chosen * tier.in_vram[i]).sum())
                    v["offs"] = tier.table[i]
            return rows

        stage0 = tier.staging_offset(i % 2)  # the staging half this layer reads

        def find(v):
            with part("fetch"):  # each routed id to its block: a VRAM slot, a staging slot, else its RAM slot
                v["offs"] = resolve(v["ids"][0], tier.table[i], tier.in_vram[i], table.held[i % 2], stage0, bb, gid0, torch.empty(K, dtype=torch.int64, device=v["x"].device), tier.uses[i],
                                    table.vram_served, table.staged_served)
                if t.cpu:  # the CPU's blocks chosen on the device and told to the host (stages/table_cpu.py)
                    table.cpu_split(v, t)
        return find

    def before(self, t, first: bool) -> None:
        if first:
            self.token_begins()

    def after(self, t) -> None:
        if t.i == len(self.table.layers) - 1:  # the token's last MoE layer is queued
            self.token_queued()

    def token_begins(self) -> None:  # the tier's refresh waits until the token's MoE layers are queued (`token_queued`)
        self.table.between_tokens(defer=True)

    def token_queued(self) -> None:
        self.table.tier.after_queued()

    # -- a step whose ids come to the host (a prompt) ---------------------------------------------------------------

    def ready(self, v: dict) -> None:
        """Before it routes: the tier's last copies landed (a prompt reads the slots the host believes in); a prompt
        takes the lookahead bank back from the hot set."""
        self.table.tier.land(wait=True)
        if not v["token"]:
            self.table.tier.reclaim_bank()

    async def on_host(self, v: dict) -> None:
        """`hold: false`: the blocks the step reads from RAM (not those in VRAM, nor those the layer before copied
        ahead) pinned there, read from disk where missing (awaited); the routing recorded (`--record-routing`)."""
        table, li, i, experts = self.table, v["li"], v["i"], v["experts"]
        if not table.stream_ram:
            return
        early = table.copied_ahead(i)
        need = experts if table.backend != "triton" else \
            [e for e in experts if (i, e) not in table.tier.slot_of and e not in early]
        await table.blocks.ensure(li.block.layer, i, need)
        if self.rt.recorder is not None:
            table.record(li.block.layer, i, v["flat"].tolist(), experts, set(experts) - set(need))

    def place(self, v: dict) -> None:
        """Where each of the step's experts is read from, in the order compute takes them: VRAM tier slots, blocks the
        layer before copied ahead (`h2d: {prompt_ahead}`), RAM (h2d's `plan` then sorts the rows into that order); each
        counted by tier; the rows each expert has (`counts`); the VRAM and copied-ahead blocks' offsets."""
        table, i, experts, stats = self.table, v["i"], v["experts"], self.rt.stats
        tier, blocks = table.tier, table.blocks
        if not table.knobs.routed:
            return
        if table.backend != "triton":
            for e in experts:
                stats.tier("vram" if (i, e) in tier.slot_of else "disk" if e in blocks.disk else "ram")
            return
        table.drop_stale_ahead(i)
        early = table.copied_ahead(i)
        in_vram = [e for e in experts if (i, e) in tier.slot_of and e not in early]
        ahead = [e for e in experts if e in early]
        in_ram = [e for e in experts if (i, e) not in tier.slot_of and e not in early]
        for e in experts:  # a block copied ahead is read from VRAM (its copy is counted as a guess copied, once)
            stats.tier("vram" if e in early or (i, e) in tier.slot_of else "disk" if e in blocks.disk else "ram")
        stats.vram_prefetch_hits += len(ahead)
        v.update(in_vram=in_vram, ahead=ahead, in_ram=in_ram, early=early,
                 counts=np.bincount(v["flat"], minlength=table.num_experts).tolist(),  # flat: numpy (route's on_host)
                 offsets=[tier.offset(i, e) for e in in_vram] + [early[e] for e in ahead])
