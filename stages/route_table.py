"""route, `via: table`: the router on the GPU, its ids kept there (no wait for them in a one-token step).

A one-token step runs the block's router and expert input on the step's stream, and (`shared: side`) its shared
expert on the side stream beside the router and the routed experts; with `shared: late` combine runs it after the
routed sum. Where the host has routed the step already (`hold: false`: the ids came to it to read misses from disk),
only the expert input runs here. A prompt's routing is the table's (stages/table.py), which brings its ids to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

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
