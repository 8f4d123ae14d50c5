"""route: the layer's router on x -> top-k expert ids and weights; ids to the host (the layer's one sync).

Also computes the expert input (the latent projection for latent MoE) and, from the ids, which
flat (token, k) positions each distinct expert serves, so compute can gather and scatter rows.
"""

from __future__ import annotations

import torch

from sluice.stages.base import Stage, StageIO
from sluice.stages.types import LayerInput, Routing


class Route(Stage):
    name = "route"
    consumes = ("layer",)
    produces = "routing"

    async def run(self, io: StageIO) -> Routing:
        li: LayerInput = await io.value("layer")
        block = li.block
        with self.rt.streams.use(self.stream):
            weights, ids = block.router(li.x)
            xe = block.expert_input(li.x)
        ids_cpu = ids.to("cpu", torch.int64)
        experts, rows = group_by_expert(ids_cpu, li.x.device)
        predicted = self.rt.stats.observe_routing(block.layer, experts)
        return Routing(weights, ids_cpu, xe, experts, rows, predicted)


def group_by_expert(ids: torch.Tensor, device: torch.device) -> tuple[tuple[int, ...], dict[int, torch.Tensor]]:
    """ids [T, K] (CPU) -> (distinct experts ascending, expert -> flat positions t*K+k, ascending)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    order_dev = order.to(device, non_blocking=True)
    rows, start = {}, 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        rows[e] = order_dev[start : start + n]
        start += n
    return tuple(experts.tolist()), rows
