"""The coordinator: runs a schedule's stage graph for each MoE layer on one asyncio event loop.

Design principle: the host waits only where data must reach it. Every stage of the schedule is
started at once as a task; a stage awaits exactly the values it needs (one-shot futures) or
iterates the channel it consumes, and `after` edges add only the waits the schedule asks for.
Disk reads are thread-pool futures; GPU work is enqueued on streams ordered by events; so the
host blocks only on the routed ids (route) and on reads that have not landed (fetch). Stages run
in a TaskGroup: the first failure cancels the rest of the layer and is re-raised as itself.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from sluice.pipeline.runtime import Runtime
from sluice.pipeline.schedule import Schedule, StageSpec
from sluice.stages import ALONE, STAGES, Stage, StageIO
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
            cls = STAGES[spec.name]
            self.producer[cls.produces] = spec.name
            if cls.channel:
                self.channels[cls.produces] = Channel()
            else:
                self.values[cls.produces] = loop.create_future()


class _IO(StageIO):
    def __init__(self, run: _LayerRun, spec: StageSpec):
        self._run, self._spec = run, spec
        self._out = STAGES[spec.name].produces

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
            (spec, STAGES[spec.name](spec.knobs, spec.stream, rt)) for spec in schedule.stages
        ]

    @property
    def whole(self) -> Stage | None:
        """The schedule's one stage when it runs a MoE layer's whole step by itself (direct), else None."""
        return self.stages[0][1] if len(self.stages) == 1 and self.stages[0][0].name in ALONE else None

    def close(self) -> None:
        for _, stage in self.stages:
            stage.close()

    async def run_layer(self, li: LayerInput) -> LayerOutput:
        run = _LayerRun(self.schedule, li)
        if len(self.stages) == 1:  # a stage that runs the whole layer (direct): no tasks to schedule
            spec, stage = self.stages[0]
            await self._run_stage(run, spec, stage, li.block.layer)
            return run.values["output"].result()
        try:
            async with asyncio.TaskGroup() as tg:
                for spec, stage in self.stages:
                    tg.create_task(self._run_stage(run, spec, stage, li.block.layer))
        except BaseExceptionGroup as eg:
            raise _first(eg) from None
        return run.values["output"].result()

    async def _run_stage(self, run: _LayerRun, spec: StageSpec, stage: Stage, layer: int) -> None:
        for a in spec.after:
            if not STAGES[a].channel:
                await run.values[STAGES[a].produces]
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
