"""Routing under control in the engine (`--routing`, storage/routing.py): each MoE layer's routed ids, and the guesses
of them, read from tables on the device at a token cursor.

The router still runs, so its cost is paid and its weights are the ones combined; only its top-k ids are replaced,
by the table's row at the step's token positions. The guesses that the predict stage and direct's lookahead make of a
layer's experts (`MoEBlock.guess`) come from the guess table, which names the true ones with the setting's recall.
Both reads are device gathers at a device cursor, so they stay pure functions of device tensors: CUDA graphs replay
them, and no id needs the host. The cursor moves on by a step's tokens at its end (`advance`, on the compute stream,
after every read of it), so every schedule sees the same ids for the same sequence of steps.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from sluice.models.base import MoEBlock
from sluice.storage.routing import RoutingSetting, for_shape, parse_routing, routing_tables


def controlled_routing(text: str | RoutingSetting | None, model, device: torch.device) -> "RoutingControl | None":
    """The routing control of setting `text` for `model` (its MoE layers' blocks replaced by routing ones), or None for
    natural routing."""
    setting = parse_routing(text)
    if not setting.controlled:
        return None
    control = RoutingControl(setting, model.moe_blocks, device)
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe = control.apply(layer.moe)
    return control


class RoutingControl:
    """The tables and cursor of one engine's controlled routing. Invariants: `ids` and `guesses` never change after
    construction; `cursor` (a device int64 scalar) only grows, by `advance`."""

    def __init__(self, setting: RoutingSetting, blocks: list[MoEBlock], device: torch.device):
        b = blocks[0]
        setting = for_shape(setting, b.num_experts, b.top_k)
        ids, guesses = routing_tables(setting, len(blocks), b.num_experts, b.top_k)
        self.setting = setting  # as run: a skewed one's calibrated knobs filled in
        self.ids = ids.to(device)  # [N, L, K] int16: routed ids per token position and MoE index
        self.guesses = guesses.to(device)  # [N, L, K] int16: their guesses
        self.positions = ids.shape[0]
        self.cursor = torch.zeros((), dtype=torch.int64, device=device)  # the next step's first token position
        self._index = {blk.layer: i for i, blk in enumerate(blocks)}

    def apply(self, block: MoEBlock) -> MoEBlock:
        """`block` routing by the tables: its router's ids and its guesses replaced (no ranking past the top-k)."""
        i, router = self._index[block.layer], block.router

        def route(x):
            weights, _ = router(x)
            return weights, self._read(self.ids, i, x.shape[0])

        def guess(x):
            weights, _ = router(x)
            return weights, self._read(self.guesses, i, x.shape[0])

        return replace(block, router=route, guess=guess, ranked=None)

    def _read(self, table: torch.Tensor, i: int, tokens: int) -> torch.Tensor:
        at = (self.cursor + torch.arange(tokens, device=table.device)) % self.positions
        return table[at, i].long()  # [T, K]

    def advance(self, tokens: int) -> None:
        """Move the cursor past a step's tokens (on the current stream: after the step's reads of it)."""
        self.cursor.add_(tokens)
