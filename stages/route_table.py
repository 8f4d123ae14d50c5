"""route, `via: table`: the router on the GPU, its ids kept there (no wait for them in a one-token step).

A one-token step runs the block's router and expert input on the step's stream, and (`shared: side`) its shared
expert on the side stream beside the router and the routed experts; with `shared: late` combine runs it after the
routed sum. Where the host has routed the step already (`hold: false`: the ids came to it to read misses from disk),
only the expert input runs here. A step the host must see the ids of (a prompt: `on_host`) brings them there, the
shared term queued while the host waits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.errors import ScheduleError
from sluice.stages.base import Stage


@dataclass(frozen=True)
class RouteTableKnobs:
    shared: str = "side"  # the block's shared term: side (one-token steps run it on a side stream beside the router and
    # the routed experts; prompts before their wait for the ids) | late (after the routed sum, in combine)

    def __post_init__(self):
        if self.shared not in ("side", "late"):
            raise ScheduleError(f"stage 'route': 'shared' must be side or late, got {self.shared!r}")


class RouteTable(Stage):
    name = "route"
    via = "table"
    consumes = ("layer",)
    produces = "routing"
    Knobs = RouteTableKnobs

    def launch(self, t):
        block, part = t.block, t.part
        if t.hosted:
            def expert_input(v):
                v["xe"] = block.expert_input(v["x"])
            return expert_input

        def route(v):
            with part("route"):
                v["weights"], v["ids"] = block.router(v["x"])
                v["xe"] = block.expert_input(v["x"])
        return route

    def beside(self, t):
        block, part = t.block, t.part
        if block.shared is None or self.knobs.shared != "side":
            return None

        def shared(v):
            with part("route"):  # beside the router, as the streaming route's `shared: early`
                v["shared"] = block.shared(v["x"])
        return shared

    async def on_host(self, v: dict) -> None:
        """A step whose ids come to the host (prompts; the torch backend; `hold: false`'s one-token steps of blocks
        whose MoE input is not pure): the router and expert input, the uses counted, the ids (with the next layer's
        guesses where h2d copies a prompt's blocks ahead) to the host, the shared term queued while the host waits."""
        table, li, i = self.table, v["li"], v["i"]
        block, k = li.block, table.knobs
        ahead = k.prompt_ahead and k.routed and table.backend == "triton" and li.next_block is not None \
            and table.tier.vram is not None and not v["token"]
        streams = self.rt.streams
        with streams.use(table.stream):
            weights, ids = block.router(li.x)
            xe = block.expert_input(li.x)
            table.tier.uses[i].index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
            both = torch.cat((ids, li.next_block.guessed(li.x)[1].to(ids.dtype)), dim=1) if ahead else ids
        host, arrived = streams.to_host(table.stream, both)
        shared = None
        if block.shared is not None and self.knobs.shared == "side":  # the GPU runs it while the host waits for the ids
            with streams.use(table.stream):
                shared = block.shared(li.x)
        await self.rt.ids_arrived(arrived)
        ids_cpu, guess = (host[:, : ids.shape[1]], host[:, ids.shape[1]:]) if ahead else (host, None)
        flat = ids_cpu.numpy().reshape(-1).astype(np.int64)  # the host's index work in numpy: torch's CPU ops wake its
        # thread pool, which cost the VRAM tier's refreshes ms on the GPU machine (BENCHMARKS.md, 2026-12-07)
        v.update(weights=weights, ids=ids, xe=xe, ids_cpu=ids_cpu, guess=guess, flat=flat, shared=shared,
                 experts=np.unique(flat).tolist() if k.routed else [])  # ascending
