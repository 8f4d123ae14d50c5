"""route: the layer's router on x -> top-k expert ids and weights; ids to the host (the layer's wait for the GPU).

Also computes the expert input (the latent projection for latent MoE) and, from the ids, which
flat (token, k) positions each distinct expert serves, so compute can gather and scatter rows.

`shared: early` (the default) enqueues the block's shared term (its shared expert, MoEBlock.shared) right after
the ids' copy to the host: the GPU runs it while the host waits for the ids and then for the layer's copies,
instead of after the routed experts, where `late` leaves it (combine runs it). The same kernels either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sluice.errors import ScheduleError
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import LayerInput, Routing


@dataclass(frozen=True)
class RouteKnobs:
    shared: str = "early"  # when the shared term runs: early (after the ids leave for the host) | late (in combine)

    def __post_init__(self):
        if self.shared not in ("early", "late"):
            raise ScheduleError(f"stage 'route': 'shared' must be early or late, got {self.shared!r}")


class Route(Stage):
    name = "route"
    consumes = ("layer",)
    produces = "routing"
    Knobs = RouteKnobs

    async def run(self, io: StageIO) -> Routing:
        li: LayerInput = await io.value("layer")
        block = li.block
        streams = self.rt.streams
        with streams.use(self.stream):
            weights, ids = block.router(li.x)
            xe = block.expert_input(li.x)
        # a one-token step: its ids into this layer's pinned buffer (Streams.host_buffer)
        ids_cpu, arrived = streams.to_host(self.stream, ids, reuse=("route", block.layer) if ids.shape[0] == 1 else None)
        shared = None
        if block.shared is not None and self.knobs.shared == "early":
            with streams.use(self.stream):
                shared = block.shared(li.x)
        await self.rt.ids_arrived(arrived)  # the layer's wait for the GPU; predict's transfer shares it
        ids_cpu = ids_cpu.long()
        experts, rows = group_by_expert(ids_cpu, li.x.device)
        predicted = self.rt.stats.observe_routing(block.layer, experts)
        return Routing(weights, ids_cpu, xe, experts, rows, predicted, shared)


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
