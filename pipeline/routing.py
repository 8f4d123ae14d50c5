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

from sluice.errors import ConfigError
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
    construction; `cursor` (a device int64 scalar) moves only by `advance`, wrapped at the tables' length."""

    def __init__(self, setting: RoutingSetting, blocks: list[MoEBlock], device: torch.device):
        b = blocks[0]
        setting = for_shape(setting, b.num_experts, b.top_k)
        ids, guesses = routing_tables(setting, len(blocks), b.num_experts, b.top_k)
        self.setting = setting  # as run: a skewed one's calibrated knobs filled in
        # per MoE index, token position: [L, N, K] int64 (4 x the int16 tables' bytes), so that a one-token read is one
        # gather: the control's own kernels are not the router's, and a step should not pay for many of them
        self.ids = _per_layer(ids, device)  # routed ids
        self.guesses = _per_layer(guesses, device)  # their guesses
        self.positions = ids.shape[0]
        self.cursor = torch.zeros((), dtype=torch.int64, device=device)  # the next step's first token position, wrapped
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
        """MoE index i's rows [T, K] at the cursor's T positions."""
        if tokens == 1:
            return table[i].index_select(0, self.cursor.view(1))
        at = (self.cursor + torch.arange(tokens, device=table.device)) % self.positions
        return table[i].index_select(0, at)

    def advance(self, tokens: int) -> None:
        """Move the cursor past a step's tokens (on the current stream: after the step's reads of it)."""
        self.cursor.add_(tokens).remainder_(self.positions)


def _per_layer(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, L, K] int16 -> [L, N, K] int64 on the device."""
    return table.to(device=device, dtype=torch.int64).transpose(0, 1).contiguous()


def check_guess_extra(extra: int, model, routing: RoutingControl | None, architecture: str) -> None:
    """Guesses past the top-k need routers that rank, and no more experts than a layer has."""
    if not extra:
        return
    if any(b.ranked is None for b in model.moe_blocks):
        whose = f"routing {routing.setting} draws its ids" if routing is not None else \
            f"this model's routers ({architecture}) do not rank (MoEBlock.ranked)"
        raise ConfigError(f"stage 'fetch': 'guess_extra' reads guesses past the top-k as a router ranks them; {whose}")
    if (b := next((b for b in model.moe_blocks if b.top_k + extra > b.num_experts), None)) is not None:
        raise ConfigError(f"stage 'fetch': 'guess_extra' {extra} past a top-{b.top_k} asks for more than the "
                          f"{b.num_experts} experts a MoE layer has")
