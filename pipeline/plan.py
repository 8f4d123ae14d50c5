"""The plan: a `via: table` schedule compiled once into each MoE layer's one-token step, composed from its stages.

Each stage of the schedule gives, for one layer, the GPU-only parts of a one-token step (`Stage.launch` on the step's
stream, `Stage.beside` on a side stream) and its host work around the step (`before`, `after`). The plan puts them
in the schedule's order: the side stream forks from the step's, runs every `beside` part (route's shared expert,
predict's guesses), the step's stream runs every `launch` part (route, fetch, compute), joins the side stream, and
the stage producing the layer's output (combine) finishes. The composed step is captured as one CUDA graph per
layer (`FnGraphs`, only for blocks whose MoE functions are pure: `MoEBlock.graph_safe`; others run it eagerly,
still without a host wait); on a CPU it runs in line. With a trace each part times itself under its stage's name
(GPU spans that the graph records on every replay). Where the CPU shares a layer's blocks (compute's `cpu_share`) the
step is composed in two parts around the CPU's rows: up to the GPU's rows (`split`, on the host's split; `token_cpu`,
on the device's) and the mix of both rows into combine's sum (stages/table_cpu.py).

A step whose routed ids must come to the host (a prompt, the torch backend, a one-token step of a block whose MoE
input is not pure over a RAM cache) runs the same stages' host faces in order (`layer`): fetch readies the tier,
route brings the ids to the host, fetch pins (reads from disk) and places the blocks, h2d plans and copies them
group by group while compute runs each group as it lands (and, with h2d's `prompt_cpu`, the CPU the blocks of few rows
beside them: compute's `beside_cpu`), h2d copies the next layer's guesses ahead, combine sums and finishes; each under
its stage's span in the trace. The values pass by name in one dict (li, i, token; weights, ids, xe, ids_cpu, flat,
experts, guess, shared; in_vram, ahead, in_ram, early, counts, offsets; cpu, cpu_pairs, rows, groups, copies, filled,
offs, at, planned; y, w, h). One-token steps over a RAM cache that route on the host and then run
the composed step are the table's (stages/table_stream.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from sluice.kernels.graphs import capturing
from sluice.pipeline.runtime import Runtime
from sluice.stages.table import Table, TableKnobs
from sluice.stages.types import LayerInput, TokenLayer

OUTPUT = "output"  # the value of the stage that finishes the step, after the side stream's join


class TokenPlan:
    def __init__(self, stages: list[tuple], rt: Runtime):
        """stages: the schedule's (spec, stage) in order, all `via: table` (but combine)."""
        knobs = {}
        for spec, _ in stages:
            knobs.update(dataclasses.asdict(spec.knobs))
        knobs["predict"] = any(spec.name == "predict" for spec, _ in stages)
        self.rt, self.stages = rt, [stage for _, stage in stages]
        self._by = {spec.name: stage for spec, stage in stages}
        self.table = Table(TableKnobs(knobs), rt)
        self.graphs = self.table.graphs
        self.table.step = self.step
        self.table.split = self.split
        for stage in self.stages:
            stage.table = self.table
        self._side = torch.cuda.Stream(rt.device) if rt.device.type == "cuda" else None
        self._steps: dict[tuple, tuple] = {}  # (model layer, whole, hosted, rows, cpu) -> (step, TokenLayer, marks)
        self._whole: tuple[list, list] | None = None  # while a graph around the steps captures (`whole`): (ran, marks)

    async def layer(self, li: LayerInput) -> torch.Tensor:
        """A MoE layer's step the composed one-token step does not run whole: its output h."""
        table = self.table
        h = await table.token_layer(li)
        if h is not None:
            return h
        route, fetch, h2d, compute, combine = (self._by[n] for n in ("route", "fetch", "h2d", "compute", "combine"))
        block, span = li.block, self.rt.tracer.span
        v = {"li": li, "i": table.index[block.layer], "token": li.x.shape[0] == 1 and table.backend == "triton"}
        fetch.ready(v)
        with span("route", layer=block.layer, stream=table.stream):
            await route.on_host(v)
        try:
            with span("fetch", layer=block.layer, stream=table.stream):
                await fetch.on_host(v)
                with self.rt.streams.use(table.stream):  # its rows go to the device on the stream that reads them
                    fetch.place(v)
            with self.rt.streams.use(table.stream):
                self._experts(v, h2d, compute)
            with span("combine", layer=block.layer, stream=table.stream):
                combine.finish(v)
        finally:
            table.blocks.release()  # also after a failed read: the engine's recovery then drops every RAM block
        return v["h"]

    def _experts(self, v: dict, h2d, compute) -> None:
        """y [T*K, Dx]: the step's routed experts, each group computed once its blocks are where it reads them."""
        table, li, span = self.table, v["li"], self.rt.tracer.span
        layer, xe = li.block.layer, v["xe"]
        v["y"] = torch.empty(xe.shape[0] * li.block.top_k, xe.shape[1], dtype=li.block.combine_dtype, device=xe.device)
        v["w"] = v["weights"].reshape(-1)
        if not table.knobs.routed:
            v["y"].zero_()
            return
        if table.backend != "triton":
            with span("compute", layer=layer, stream=table.stream):
                compute.reference(v)
            return
        with span("h2d", layer=layer, stream=table.stream):
            h2d.plan(v)
        with contextlib.ExitStack() as beside:
            try:
                beside.enter_context(compute.beside_cpu(v))  # the CPU's blocks of few rows (h2d's `prompt_cpu`)
                with span("compute", layer=layer, stream=table.stream):
                    if v["in_vram"]:
                        compute.group(v, v["in_vram"])
                    table.settle_ahead()  # the step's stream waits for the copies ahead; the tier slots they filled pointed at
                    if v["ahead"]:
                        compute.group(v, v["ahead"])
                    for group in h2d.copied(v):
                        compute.group(v, group)
            except BaseException:  # tier slots planned for copies that may not have been queued: free again, unread
                table.unfill(v["filled"])
                raise
            with span("h2d", layer=layer, stream=table.stream):
                h2d.landed(v)
                h2d.look_ahead(v)

    def token(self, layer, h: torch.Tensor, nxt, first: bool = True) -> torch.Tensor | None:
        """A one-token step of MoE `layer` whole from its input h [1, 1, D] (its norm included: one replay is the
        layer's whole host cost), or None where the host must act first (`layer`). `first`: the token's host work
        of its first MoE layer is due here (a whole step does it before its replay: `begin_token`)."""
        block, table = layer.moe, self.table
        if table.backend != "triton" or not block.graph_safe or table.stream_ram or table.cpu_now:
            return None
        with self.rt.tracer.span(table.name, layer=block.layer, stream=table.stream):
            return self.step(block, nxt, layer, (h,), first=first)

    def takes_rows(self, block) -> bool:
        """Whether a batched step's decode rows of `block`'s layer run as one composed step (`rows`): the kernels run
        on the GPU with every block held (RAM or VRAM), and compute's `batch_rows` is `device`."""
        table = self.table
        return (table.backend == "triton" and not table.stream_ram and table.knobs.routed
                and table.knobs.batch_rows == "device")

    def rows(self, block, nxt, x: torch.Tensor, residual: torch.Tensor, first: bool) -> torch.Tensor:
        """A batched step's T decode rows of `block`'s layer (x [T, D], residual [1, T, D]) as one composed step with no
        host wait, replayed as a graph per T where the block's functions are pure: h [1, T, D]. `first`: the step's
        first MoE layer (the tier's turn is due)."""
        with self.rt.tracer.span(self.table.name, layer=block.layer, stream=self.table.stream):
            return self.step(block, nxt, None, (x, residual), first=first, rows=x.shape[0])

    def variant(self) -> bool:
        """Before a token replayed whole: which of its captured steps it runs (the table's choice, `cpu_choose`: with the
        CPU's share of the blocks, or without it)."""
        return self.table.cpu_choose()

    def begin_token(self) -> None:
        """The host work due once a token before its first MoE layer (fetch: the VRAM tier's turn)."""
        for stage in self.stages:
            stage.token_begins()

    def token_queued(self) -> None:
        """The host work that waits until a whole step is queued, beside the GPU's work (fetch: a deferred refresh)."""
        for stage in self.stages:
            stage.token_queued()

    @contextlib.contextmanager
    def whole(self):
        """Steps composed into a graph around them (pipeline/whole.py) while this is open: their tallies are left to
        `replayed`, their parts' trace marks go to the graph's own list. Yields (the TokenLayers of the steps that
        ran, in order; the marks)."""
        ran, marks = [], []
        self._whole = (ran, marks)
        try:
            yield ran, marks
        except BaseException:
            self.table.copied = [None, None]  # events a failed capture recorded: never to be waited on
            raise
        finally:
            self._whole = None

    def replayed(self, ran: list, marks: list) -> None:
        """A graph holding the steps `ran` (and their parts' `marks`) replayed: their tallies and GPU spans."""
        for t in ran:
            for stage in self.stages:
                stage.tally(t)
        self.rt.tracer.replayed(marks)

    def step(self, block, nxt, layer, args: tuple, routing: tuple | None = None, first: bool = True,
             rows: int = 1) -> torch.Tensor:
        """The composed one-token step of `block`'s layer on args: (h,) with `layer` (its MoE input in the step), else
        (x [rows, D], residual); `routing`: (weights, ids, offs) found by the host. `first`: the stages' host work of a
        token's first MoE layer is due (the table's host side did it already when it routed)."""
        fn, t, marks = self._made(block, nxt, layer, routing is not None, rows)
        for stage in self.stages:
            stage.before(t, first and t.i == 0)
        graphs = self.graphs
        replays = graphs.replays if graphs is not None else 0
        with self.rt.streams.use(self.table.stream):
            h = fn(*args, *(routing or ()))
        if graphs is not None and graphs.replays > replays:  # a replay: its parts' spans, read at flush
            self.rt.tracer.replayed(marks)
        self._ran(t)
        return h

    def _made(self, block, nxt, layer, hosted: bool, rows: int = 1, cpu: bool = False) -> tuple:
        """The composed step of these kinds (`_compose`), made once: (its function or, with `cpu`, its two parts; its
        TokenLayer; its trace marks)."""
        key = (block.layer, layer is None, hosted, rows, cpu)
        made = self._steps.get(key)
        if made is None:  # its constants made on the stream that reads them
            with self.rt.streams.use(self.table.stream):
                made = self._steps[key] = self._compose(block, nxt, layer, hosted, rows, cpu)
        return made

    def _ran(self, t) -> None:
        """A step's host work after it is queued: the stages' `after`, and their tallies (or, inside a graph around
        the steps, t kept for `replayed`)."""
        for stage in self.stages:
            stage.after(t)
        if self._whole is None:
            for stage in self.stages:
                stage.tally(t)
        else:
            self._whole[0].append(t)

    def split(self, block, nxt, args: tuple, routing: tuple, first: bool) -> Callable:
        """A one-token step of `block`'s layer whose routed blocks the CPU shares (compute's `cpu_share`), in two parts:
        the first queued now on args (x, residual) and routing (weights, ids, offs: the CPU's blocks at a zero block),
        the shared term and the GPU's rows unsummed; returns finish(cpu_y [K, Dx], cpu_mask [K] bool) -> h, which
        queues the second: the CPU's rows in place, the fixed-order sum, combine. Each part a graph where pure."""
        (gpu, mix), t, marks = self._made(block, nxt, None, True, cpu=True)
        for stage in self.stages:
            stage.before(t, first and t.i == 0)
        graphs, streams = self.graphs, self.rt.streams
        replays = graphs.replays if graphs is not None else 0
        with streams.use(self.table.stream):
            rows = gpu(*args, *routing)

        def finish(cpu_y: torch.Tensor, cpu_mask: torch.Tensor) -> torch.Tensor:
            with streams.use(self.table.stream):
                h = mix(*rows[:3], cpu_y, cpu_mask, *rows[3:])
            if graphs is not None and graphs.replays > replays:
                self.rt.tracer.replayed(marks)
            self._ran(t)
            return h
        return finish

    def token_cpu(self, block, nxt, layer, args: tuple):
        """A one-token step of `block`'s layer whose blocks the CPU shares, the split made on the device (a whole step:
        pipeline/whole.py): its first part queued now on args ((h,) with `layer`, else (x, residual)): the
        router, the CPU's blocks chosen and told to the host (stages/table_cpu.py), the GPU's rows. Returns the table's
        `CpuTurn`: the host's part after the replay, and the mix (after the GPU's wait for it, or in the next segment)."""
        (gpu, mix), t, marks = self._made(block, nxt, layer, False, cpu=True)
        for stage in self.stages:
            stage.before(t, False)
        with self.rt.streams.use(self.table.stream):
            x, residual, y, mask, *shared = gpu(*args)
        self._ran(t)
        return self.table.cpu_turn(block, t.i, lambda cpu_y: mix(x, residual, y, cpu_y, mask, *shared))

    def _compose(self, block, nxt, layer, hosted: bool, rows: int = 1, cpu: bool = False) -> tuple:
        tracer, table = self.rt.tracer, self.table
        marks: list = []
        untimed = contextlib.nullcontext()
        part = (lambda name: tracer.phase(name, block.layer, table.stream, marks if self._whole is None else self._whole[1])) \
            if tracer.enabled else (lambda name: untimed)  # noqa: E731
        t = TokenLayer(block, table.index[block.layer], nxt, hosted, part, rows, cpu)
        besides = [f for s in self.stages if (f := s.beside(t)) is not None]
        launches = [f for s in self.stages if s.produces != OUTPUT and (f := s.launch(t)) is not None]
        finish = [f for s in self.stages if s.produces == OUTPUT and (f := s.launch(t)) is not None]
        side = self._side if besides else None

        def experts(x, residual, *routing):
            captured = capturing()
            if marks and captured and self._whole is None:
                marks.clear()  # a new capture records its own parts (a graph around it keeps its own: `whole`)
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
                if shared is not None and not captured:  # eager: not reused before the step's stream reads it
                    shared.record_stream(main)
            if cpu:  # what `mix` takes once the CPU's rows are in: (x, residual, y[, the device's CPU mask][, shared])
                return (v["x"], v["residual"], v["y"], *((v["cpu_mask"],) if "cpu_mask" in v else ()),
                        *((v["shared"],) if v.get("shared") is not None else ()))
            _run(finish, v)
            return v["h"]

        if cpu:
            def mix(x, residual, y, cpu_y, cpu_mask, *shared):
                v = {"x": x, "residual": residual, "y": y, "cpu_y": cpu_y, "cpu_mask": cpu_mask}
                if shared:
                    v["shared"] = shared[0]
                _run(finish, v)
                return v["h"]

            first = experts if layer is None else lambda h: experts(*layer.moe_input(h, None))
            graphed = self.graphs is not None and block.graph_safe
            wrap = (lambda fn, name: self.graphs.wrap(fn, name)) if graphed else (lambda fn, name: fn)  # noqa: E731
            tag = ("+ids" if hosted else "+input" if layer is not None else "") + "+cpu"
            return (wrap(first, f"direct{tag}:{block.layer}"), wrap(mix, f"direct+mix:{block.layer}")), t, marks

        step = experts if layer is None else lambda h: experts(*layer.moe_input(h, None))
        tags = ('' if layer is None else '+input') + ('+ids' if hosted else '') + (f'+rows{rows}' if rows > 1 else '')
        name = f"direct{tags}:{block.layer}"
        graphed = self.graphs is not None and block.graph_safe
        return (self.graphs.wrap(step, name) if graphed else step), t, marks


def _run(parts: list, v: dict) -> None:
    for f in parts:
        f(v)

