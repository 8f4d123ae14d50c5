"""predict, `via: table`: a one-token step's guesses for the next MoE layer, kept on the GPU for h2d to copy ahead.

On the side stream (`beside`; else in line, in the schedule's order), the next MoE layer's router runs on this layer's input; of its top-k (most likely first), the
first blocks that VRAM lacks, as many as a staging half holds (h2d's `token_ahead`), are written with their RAM
offsets into the table's guess list for that layer's parity (kernels/ahead.py `select`), and counted as copies.
h2d copies them after the step; without this stage (or with `token_ahead: 0`) nothing is staged. Reads from disk of
guesses (`hold: false`) are the fetch stage's.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.kernels.ahead import select
from sluice.stages.base import Stage


@dataclass(frozen=True)
class PredictTableKnobs:
    beside: bool = True  # the guesses on the side stream, beside the router and the routed experts; false: in line on
    # the step's stream, in the schedule's order (after route where the file lists route first; the same guesses)


class PredictTable(Stage):
    name = "predict"
    via = "table"
    consumes = ("layer",)
    produces = "prediction"
    Knobs = PredictTableKnobs

    def beside(self, t):
        return self._guess(t) if self.knobs.beside else None

    def launch(self, t):
        return None if self.knobs.beside else self._guess(t)

    def _guess(self, t):
        table, nxt, part = self.table, t.nxt, t.part
        tier = table.tier
        if nxt is None or not tier.S or t.rows > 1:  # a batched step's rows stage nothing
            return None
        j, E = t.i + 1, table.num_experts

        def guess(v):
            with part("predict"):
                select(nxt.guessed(v["x"])[1][0], tier.in_vram[j], tier.table[j], j * E, table.guess_ids[j % 2],
                       table.guess_src[j % 2], table.staged_copies)
        return guess
