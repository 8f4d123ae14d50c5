"""The plan: a `via: table` schedule compiled once into each MoE layer's one-token step, composed from its stages.

Each stage of the schedule gives, for one layer, the GPU-only parts of a one-token step (`Stage.launch` on the step's
stream, `Stage.beside` on a side stream) and its host work around the step (`before`, `after`). The plan puts them
in the schedule's order: the side stream forks from the step's, runs every `beside` part (route's shared expert,
predict's guesses), the step's stream runs every `launch` part (route, fetch, compute), joins the side stream, and
the stage producing the layer's output (combine) finishes. The composed step is captured as one CUDA graph per
layer (`FnGraphs`, only for blocks whose MoE functions are pure: `MoEBlock.graph_safe`; others run it eagerly,
still without a host wait); on a CPU it runs in line. With a trace each part times itself under its stage's name
(GPU spans that the graph records on every replay).

What the step cannot do without the host (prompts, a routed-id wait over a RAM cache, the torch backend) is the
device table's (stages/table.py `Table.layer`), which calls back into the plan's step where it can.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from sluice.pipeline.runtime import Runtime
from sluice.stages.table import Table, TableKnobs
from sluice.stages.types import TokenLayer

OUTPUT = "output"  # the value of the stage that finishes the step, after the side stream's join


class TokenPlan:
    def __init__(self, stages: list[tuple], rt: Runtime):
        """stages: the schedule's (spec, stage) in order, all `via: table` (but combine)."""
        knobs = {}
        for spec, _ in stages:
            knobs.update(dataclasses.asdict(spec.knobs))
        knobs["predict"] = any(spec.name == "predict" for spec, _ in stages)
        self.rt, self.stages = rt, [stage for _, stage in stages]
        cuda = rt.device.type == "cuda"
        self.graphs = None
        if knobs["graphs"] and cuda and knobs["backend"] in ("auto", "triton"):
            from sluice.kernels.graphs import FnGraphs

            self.graphs = FnGraphs(rt.pools)
        self.table = Table(TableKnobs(knobs), rt, self.graphs)
        self.table.step = self.step
        for stage in self.stages:
            stage.table = self.table
        self._side = torch.cuda.Stream(rt.device) if cuda else None
        self._steps: dict[tuple, tuple] = {}  # (model layer, whole, hosted) -> (step, TokenLayer, marks)

    def token(self, layer, h: torch.Tensor, nxt) -> torch.Tensor | None:
        """A one-token step of MoE `layer` whole from its input h [1, 1, D] (its norm included: one replay is the
        layer's whole host cost), or None where the table's host side must act (stages/table.py `Table.layer`)."""
        block, table = layer.moe, self.table
        if not table.steps_on_gpu(block) or not block.graph_safe or table.stream_ram:
            return None
        with self.rt.tracer.span(table.name, layer=block.layer, stream=table.stream):
            return self.step(block, nxt, layer, (h,))

    def step(self, block, nxt, layer, args: tuple, routing: tuple | None = None, first: bool = True) -> torch.Tensor:
        """The composed one-token step of `block`'s layer on args: (h,) with `layer` (its MoE input in the step), else
        (x [1, D], residual); `routing`: (weights, ids, offs) found by the host. `first`: the stages' host work of a
        token's first MoE layer is due (the table's host side did it already when it routed)."""
        key = (block.layer, layer is None, routing is not None)
        made = self._steps.get(key)
        if made is None:
            made = self._steps[key] = self._compose(block, nxt, layer, routing is not None)
        fn, t, marks = made
        for stage in self.stages:
            stage.before(t, first and t.i == 0)
        graphs = self.graphs
        replays = graphs.replays if graphs is not None else 0
        with self.rt.streams.use(self.table.stream):
            h = fn(*args, *(routing or ()))
        if graphs is not None and graphs.replays > replays:  # a replay: its parts' spans, read at flush
            self.rt.tracer.replayed(marks)
        for stage in self.stages:
            stage.after(t)
        return h

    def _compose(self, block, nxt, layer, hosted: bool) -> tuple:
        tracer, table = self.rt.tracer, self.table
        marks: list = []
        untimed = contextlib.nullcontext()
        part = (lambda name: tracer.phase(name, block.layer, table.stream, marks)) if tracer.enabled else \
            (lambda name: untimed)  # noqa: E731
        t = TokenLayer(block, table.index[block.layer], nxt, hosted, part)
        besides = [f for s in self.stages if (f := s.beside(t)) is not None]
        launches = [f for s in self.stages if s.produces != OUTPUT and (f := s.launch(t)) is not None]
        finish = [f for s in self.stages if s.produces == OUTPUT and (f := s.launch(t)) is not None]
        side = self._side if besides else None

        def experts(x, residual, *routing):
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if marks and capturing:
                marks.clear()  # a new capture records its own parts
            v = {"x": x, "residual": residual}
            if routing:
                v["weights"], v["ids"], v["offs"] = routing
            if side is None:  # a CPU, or nothing beside: in line
                _run(besides, v)
                _run(launches, v)
            else:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    _run(besides, v)
                _run(launches, v)
                main.wait_stream(side)
                shared = v.get("shared")
                if shared is not None and not capturing:  # eager: not reused before the step's stream reads it
                    shared.record_stream(main)
            _run(finish, v)
            return v["h"]

        step = experts if layer is None else lambda h: experts(*layer.moe_input(h, None))
        name = f"direct{'' if layer is None else '+input'}{'+ids' if hosted else ''}:{block.layer}"
        graphed = self.graphs is not None and block.graph_safe and table.backend == "triton"
        return (self.graphs.wrap(step, name) if graphed else step), t, marks


def _run(parts: list, v: dict) -> None:
    for f in parts:
        f(v)

