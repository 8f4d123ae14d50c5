"""The coordinator: runs a schedule's stage graph for each MoE layer on one asyncio event loop.

Design principle: the host waits only where data must reach it. Every stage of the schedule is
started at once as a task; a stage awaits exactly the values it needs (one-shot futures) or
iterates the channel it consumes, and `after` edges add only the waits the schedule asks for.
Disk reads are thread-pool futures; GPU work is enqueued on streams ordered by events; so the
host blocks only on the routed ids (route) and on reads that have not landed (fetch). Stages run
in a TaskGroup: the first failure cancels the rest of the layer and is re-raised as itself.

`moe` is the engine's one call per MoE layer: it builds the layer's input (with the graph views of a one-token
step), or, for a `via: table` schedule, runs a one-token layer whole as the plan's composed step (pipeline/plan.py)
and any other step through the same stages' host faces (`TokenPlan.layer`).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import torch

from sluice.pipeline.plan import TokenPlan
from sluice.pipeline.runtime import Runtime
from sluice.pipeline.schedule import Schedule, StageSpec
from sluice.stages import Stage, StageIO
from sluice.stages.types import LayerInput, LayerOutput

_WAVE = object()
_END = object()


class Channel:
    """Items from one producer stage to one consumer, with wave boundaries."""

    def __init__(self) -> None:
        self._q: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        self._q.put_nowait(item)

    def wave(self) -> None:
        self._q.put_nowait(_WAVE)

    def close(self) -> None:
        self._q.put_nowait(_END)

    async def batches(self, by_wave: bool) -> AsyncIterator[list]:
        batch: list = []
        while True:
            item = await self._q.get()
            while True:  # take everything already queued
                if item is _END:
                    if batch:
                        yield batch
                    return
                if item is _WAVE:
                    if by_wave and batch:
                        yield batch
                        batch = []
                else:
                    batch.append(item)
                if self._q.empty():
                    break
                item = self._q.get_nowait()
            if not by_wave and batch:
                yield batch
                batch = []


class _LayerRun:
    """The values and channels of one layer's run of the graph."""

    def __init__(self, schedule: Schedule, li: LayerInput):
        loop = asyncio.get_running_loop()
        self.values: dict[str, asyncio.Future] = {"layer": loop.create_future()}
        self.values["layer"].set_result(li)
        self.channels: dict[str, Channel] = {}
        self.producer: dict[str, str] = {}
        for spec in schedule.stages:
            cls = spec.cls
            self.producer[cls.produces] = spec.name
            if cls.channel:
                self.channels[cls.produces] = Channel()
            else:
                self.values[cls.produces] = loop.create_future()


class _IO(StageIO):
    def __init__(self, run: _LayerRun, spec: StageSpec):
        self._run, self._spec = run, spec
        self._out = spec.cls.produces

    async def value(self, name: str) -> Any:
        return await self._run.values[name]

    def has(self, name: str) -> bool:
        return name in self._run.values or name in self._run.channels

    def batches(self, name: str) -> AsyncIterator[list]:
        return self._run.channels[name].batches(by_wave=self._run.producer[name] in self._spec.after)

    def emit(self, item: Any) -> None:
        self._run.channels[self._out].put(item)

    def end_wave(self) -> None:
        self._run.channels[self._out].wave()


class Coordinator:
    def __init__(self, schedule: Schedule, rt: Runtime):
        self.schedule = schedule
        self.rt = rt
        self.stages: list[tuple[StageSpec, Stage]] = [
            (spec, spec.cls(spec.knobs, spec.stream, rt)) for spec in schedule.stages
        ]
        needs = schedule.needs
        self.plan = TokenPlan(self.stages, rt) if needs.table else None  # the fast path's composed steps
        self._depth = needs.depth
        self._next: list = []  # per MoE index: the next MoE block (None after the last)
        self._ahead: list[tuple] = []  # per MoE index: the blocks guessed past the next one (`Needs.depth`)
        self._views: dict[int, tuple] = {}  # model layer -> (MoE input, block, next block) replaying graphs

    def bind(self, model, fn_graphs=None) -> None:
        """The model whose MoE layers this runs; with `fn_graphs` (CUDA), one-token steps of graph-safe blocks run
        their pure parts as graph replays (the predict stage's router of the next block under names of its own)."""
        blocks = model.moe_blocks
        self._next = blocks[1:] + [None]
        self._ahead = [tuple(blocks[i + 2 : i + 1 + self._depth]) for i in range(len(blocks))]
        self._views = {}
        if fn_graphs is None:
            return
        whole = self.plan is not None  # the plan captures each layer's step whole: plain blocks
        for i, layer in enumerate(model.layers):
            b = layer.moe
            if b is not None and b.graph_safe:
                nxt = self._next[b.index]
                moe_input = fn_graphs.wrap(lambda h, f=layer.moe_input: f(h, None), f"moe_input:{b.layer}")
                self._views[i] = (moe_input, b if whole else fn_graphs.block(b, "route"),
                                  nxt if whole or nxt is None or not nxt.graph_safe else fn_graphs.block(nxt, "predict"))

    async def moe_rows(self, layer, hs: list[torch.Tensor], ctxs: list) -> list[torch.Tensor]:
        """A MoE layer over several sequences' inputs hs [1, T_b, D] at once (pipeline/batch.py): their rows run as
        one step of sum(T_b) tokens; each sequence's output h."""
        block = layer.moe
        if (out := self.rows(layer, hs, ctxs, first=block.index == 0)) is not None:
            return out
        x, residual = _packed(layer, hs, ctxs)
        decoding = all(h.shape[1] == 1 for h in hs)
        li = LayerInput(block, self._next[block.index], x, residual, self._ahead[block.index], decoding)
        return list((await self.run_layer(li)).h.split([h.shape[1] for h in hs], dim=1))

    def rows(self, layer, hs: list[torch.Tensor], ctxs: list, first: bool) -> list[torch.Tensor] | None:
        """Several sequences' one-token steps of MoE `layer` (hs [1, 1, D]) as the plan's composed step over their rows,
        queued with no host wait, or None where the host must act or no plan composes it. `first`: the token's host
        work is due here (a whole step does it before its replay: `begin_token`)."""
        block = layer.moe
        if len(hs) < 2 or any(h.shape[1] != 1 for h in hs) or self.plan is None or not self.plan.takes_rows(block):
            return None
        x, residual = _packed(layer, hs, ctxs)
        return list(self.plan.rows(block, self._next[block.index], x, residual, first).split(1, dim=1))

    def token(self, layer, h: torch.Tensor, ctx) -> torch.Tensor | None:
        """A one-token step of MoE `layer` on h [1, 1, D] queued with no host wait (the plan's composed step, from h or,
        for a block whose MoE input is not pure, from the layer's MoE input; the token's first host work is the
        caller's: `plan.begin_token`), or None where the host must act or no plan composes it; where the CPU shares the
        layer's blocks, its first part queued and a CpuTurn (stages/table_cpu.py) for the rest."""
        if self.plan is None:
            return None
        block = layer.moe
        nxt = self._next[block.index]
        if self.plan.table.cpu_now:  # a CpuTurn: the host's part and the rest (pipeline/whole.py)
            args = (h,) if block.graph_safe else layer.moe_input(h, ctx)
            return self.plan.token_cpu(block, nxt, layer if block.graph_safe else None, args)
        if block.graph_safe:
            return self.plan.token(layer, h, nxt, first=False)
        return self.plan.step(block, nxt, None, layer.moe_input(h, ctx), first=False)

    async def moe(self, i: int, layer, h: torch.Tensor, ctx, graphs: bool) -> torch.Tensor:
        """Model layer i (a MoE layer) on h [B, T, D]: its output h. `graphs`: a one-token step replaying graphs."""
        block = layer.moe
        nxt, ahead = self._next[block.index], self._ahead[block.index]
        if h.shape[1] == 1 and self.plan is not None and (out := self.plan.token(layer, h, nxt)) is not None:
            return out
        view = self._views.get(i) if graphs else None
        if view is None:
            x, residual = layer.moe_input(h, ctx)
        else:
            moe_input, block, nxt = view
            x, residual = moe_input(h)
        return (await self.run_layer(LayerInput(block, nxt, x, residual, ahead))).h

    def empty_vram(self) -> None:
        """Give back the blocks the stages (or the device table) keep in VRAM themselves; the host has synchronized."""
        for _, stage in self.stages:
            stage.empty_vram()
        if self.plan is not None:
            self.plan.table.empty_vram()

    def close(self) -> None:
        for _, stage in self.stages:
            stage.close()

    async def run_layer(self, li: LayerInput) -> LayerOutput:
        if self.plan is not None:  # the table stages' steps that are not one composed one-token step
            table = self.plan.table
            with self.rt.tracer.span(table.name, layer=li.block.layer, stream=table.stream):
                return LayerOutput(await self.plan.layer(li))
        run = _LayerRun(self.schedule, li)
        try:
            async with asyncio.TaskGroup() as tg:
                for spec, stage in self.stages:
                    tg.create_task(self._run_stage(run, spec, stage, li.block.layer))
        except BaseExceptionGroup as eg:
            raise _first(eg) from None
        return run.values["output"].result()

    async def _run_stage(self, run: _LayerRun, spec: StageSpec, stage: Stage, layer: int) -> None:
        for a in spec.after:
            cls = self.schedule.stage(a).cls
            if not cls.channel:
                await run.values[cls.produces]
        with self.rt.tracer.span(spec.name, layer=layer, stream=spec.stream):
            result = await stage.run(_IO(run, spec))
        if stage.channel:
            run.channels[stage.produces].close()
        else:
            run.values[stage.produces].set_result(result)


def _first(eg: BaseExceptionGroup) -> BaseException:
    e: BaseException = eg
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def _packed(layer, hs: list[torch.Tensor], ctxs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's input over several sequences' rows: (x [sum(T_b), D], residual [1, sum(T_b), D])."""
    packed = layer.moe_input_rows(hs, ctxs)
    if packed is None:
        parts = [layer.moe_input(h, ctx) for h, ctx in zip(hs, ctxs)]
        packed = torch.cat([x for x, _ in parts]), torch.cat([r for _, r in parts], dim=1)
    return packed
