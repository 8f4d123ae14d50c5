"""route: the layer's router on x -> top-k expert ids and weights; ids to the host (the layer's wait for the GPU).

Also computes the expert input (the latent projection for latent MoE) and, from the ids, which
flat (token, k) positions each distinct expert serves, so compute can gather and scatter rows.
"""

from __future__ import annotations

from collections.abc import Mapping

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
        streams = self.rt.streams
        with streams.use(self.stream):
            weights, ids = block.router(li.x)
            xe = block.expert_input(li.x)
        ids_cpu, arrived = streams.to_host(self.stream, ids)
        await streams.arrived(arrived)  # the layer's wait for the GPU; predict's transfer shares it
        ids_cpu = ids_cpu.long()
        experts, rows = group_by_expert(ids_cpu, li.x.device)
        predicted = self.rt.stats.observe_routing(block.layer, experts)
        return Routing(weights, ids_cpu, xe, experts, rows, predicted)


class OneTokenRows(Mapping):
    """expert -> flat positions for a one-token step, where each of the K distinct experts serves one position:
    the positions as host ints (`positions`), device tensors made only when asked for (the torch and CPU
    paths). A decode step builds no device tensor here: the Triton path sends the positions with the
    blocks' offsets in one copy (stages/compute.py)."""

    def __init__(self, positions: dict[int, int], device: torch.device):
        self.positions = positions
        self._device = device
        self._made: dict[int, torch.Tensor] = {}

    def __getitem__(self, expert: int) -> torch.Tensor:
        t = self._made.get(expert)
        if t is None:
            # through pinned-free staging, not torch.tensor(device=...): that copy waits for the whole stream
            t = self._made[expert] = torch.tensor([self.positions[expert]]).to(self._device, non_blocking=True)
        return t

    def __iter__(self):
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)


def group_by_expert(ids: torch.Tensor, device: torch.device) -> tuple[tuple[int, ...], Mapping[int, torch.Tensor]]:
    """ids [T, K] (CPU) -> (distinct experts ascending, expert -> flat positions t*K+k, ascending)."""
    if ids.shape[0] == 1:
        ks = ids[0].tolist()
        positions = {e: k for k, e in enumerate(ks)}
        if len(positions) == len(ks):  # a router's top-k: distinct experts
            return tuple(sorted(positions)), OneTokenRows(positions, device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    order_dev = order.to(device, non_blocking=True)
    rows, start = {}, 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        rows[e] = order_dev[start : start + n]
        start += n
    return tuple(experts.tolist()), rows
