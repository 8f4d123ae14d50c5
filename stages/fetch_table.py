"""fetch, `via: table`: each routed expert to the byte offset its kernels read it at, through a device table.

Every block is held in pinned RAM (`hold: true`); the table (stages/table_tier.py) points each (MoE layer, expert)
at its VRAM tier slot or its RAM slot, and a one-token step resolves its routed ids on the GPU (kernels/ahead.py
`resolve`: a staged guess's slot wins over RAM), counting the uses the tier's refreshes rank by. With `hold: false`
RAM is an LRU cache filled from disk: the table's host side brings each step's ids to the host, reads what neither
tier holds and sends the offsets it found (`TokenLayer.hosted`); the step then only counts the uses. The tier's turn
(its copies landed, every `refresh` tokens a new hot set) comes before a token's first MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        if self.margin < 0:
            raise ScheduleError(f"stage 'fetch': 'margin' must be >= 0, got {self.margin!r}")
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

        stage0 = tier.staging_offset(i % 2)  # the staging half this layer reads

        def find(v):
            with part("fetch"):  # each routed id to its block: a VRAM slot, a staging slot, else its RAM slot
                v["offs"] = resolve(v["ids"][0], tier.table[i], tier.in_vram[i], table.held[i % 2], stage0, bb, gid0, torch.empty(K, dtype=torch.int64, device=v["x"].device), tier.uses[i],
                                    table.vram_served, table.staged_served)
        return find

    def before(self, t, first: bool) -> None:
        if first:
            self.table.between_tokens()
