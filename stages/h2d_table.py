"""h2d, `via: table`: blocks cross PCIe where they are read (zero-copy), or are copied into VRAM ahead of their layer.

A one-token step's kernels read the blocks VRAM lacks from pinned RAM themselves. With `token_ahead` N, the next
MoE layer's guessed blocks (predict's list, chosen in the step just queued) are copied into a staging half of N of
the tier's slots, on a stream of their own, while the resident layers before that layer run: that layer's step waits
for them and reads them there. Prompts (stages/table_prompt.py) copy RAM blocks into VRAM `prompt_group` at a time,
into free tier slots first (`prompt_fill`), and copy the next layer's guessed blocks ahead (`prompt_ahead`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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
    prompt_ahead: int = 32  # prompts: the next MoE layer's blocks, guessed by its router on this layer's input, copied
    # while this layer computes: into free tier slots (as many as are free), then up to this many into a bank of
    # 2 x this many of the tier's slots (at most half of them), which one-token steps lend back to the tier; 0: off

    def __post_init__(self):
        if self.prompt_ahead < 0:
            raise ScheduleError(f"stage 'h2d': 'prompt_ahead' must be >= 0, got {self.prompt_ahead!r}")


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
        if not table.tier.S or t.nxt is None:
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
