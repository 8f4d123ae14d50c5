"""h2d: RAM slot -> VRAM slot on the schedule's stream, one event per block.

On a CPU there is nothing to copy: compute reads the RAM slot in place, and the RAM pin is held
until compute releases the block. On CUDA each block is copied (non-blocking, from pinned memory)
into a slot of the VRAM bank; the RAM pin is dropped as soon as the copy is enqueued, with the
copy's event attached so the slot is not refilled before the copy has read it. When the VRAM
bank has no free slot the stage ends a wave and waits for compute to release one.

`copy: up` (zero-copy down) copies every projection but `down`; compute then reads `down`
straight from the pinned RAM slot over PCIe, and the RAM pin is held until compute is done.
With zero-skip in compute, only the 16-neuron groups live after ReLU^2 cross the bus.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.errors import ScheduleError
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import DeviceBlock, HostBlock


@dataclass(frozen=True)
class H2DKnobs:
    copy: str = "all"  # all | up (leave `down` in pinned RAM for the zero-copy kernel)


class H2D(Stage):
    name = "h2d"
    consumes = ("layer", "blocks")
    produces = "device_blocks"
    channel = True
    Knobs = H2DKnobs

    def __init__(self, knobs, stream, rt):
        super().__init__(knobs, stream, rt)
        if knobs.copy not in ("all", "up"):
            raise ScheduleError(f"stage 'h2d': 'copy' must be all or up, got {knobs.copy!r}")
        down = rt.layouts.get("down")
        # bytes to copy: the whole block, or everything before `down` (blocks keep projections in order)
        self._nbytes = down.start if knobs.copy == "up" and down is not None else rt.store.block_bytes

    async def run(self, io: StageIO) -> None:
        layer = (await io.value("layer")).block.layer
        async for batch in io.batches("blocks"):
            for hb in batch:
                io.emit(await self._place(io, layer, hb))
            io.end_wave()  # pass the upstream wave boundary on

    async def _place(self, io: StageIO, layer: int, hb: HostBlock) -> DeviceBlock:
        rt = self.rt
        n = rt.store.block_bytes
        if hb.vram is not None:  # a VRAM hit: up is there; down too unless it stays in RAM
            v = hb.vram
            if self._nbytes == n:
                return DeviceBlock(hb.expert, rt.vram.arena.data, v.slot * n, rt.vram.arena.data, v.slot * n, v.filled,
                                   lambda done, v=v: rt.vram.unpin(v, done))
        if rt.vram is None:
            e = hb.ram
            return DeviceBlock(hb.expert, rt.ram.arena.data, e.slot * n, rt.ram.arena.data, e.slot * n, None,
                               lambda done, e=e: rt.ram.unpin(e, done))
        return await self._copy(io, layer, hb)

    async def _copy(self, io: StageIO, layer: int, hb: HostBlock) -> DeviceBlock:
        rt, streams, n = self.rt, self.rt.streams, self.rt.store.block_bytes
        ram = hb.ram
        if hb.vram is not None:  # zero-copy down of a VRAM hit: up in VRAM, down still needed from RAM
            v, copied = hb.vram, hb.vram.filled
        else:
            key = (layer, hb.expert)
            v = rt.vram.try_reserve(key)
            if v is None:
                io.end_wave()
                v = await rt.vram.reserve(key)
            with streams.use(self.stream):
                streams.wait(self.stream, v.reuse_after)
                v.buf[: self._nbytes].copy_(ram.buf[: self._nbytes], non_blocking=True)
                copied = streams.record(self.stream)
            v.reuse_after = None
            v.filled = copied
        vbank, hbank = rt.vram.arena.data, rt.ram.arena.data
        if self._nbytes == n:
            rt.ram.unpin(ram, copied)
            return DeviceBlock(hb.expert, vbank, v.slot * n, vbank, v.slot * n, copied, lambda done, v=v: rt.vram.unpin(v, done))

        def release(done, v=v, ram=ram):
            rt.vram.unpin(v, done)
            rt.ram.unpin(ram, done)

        return DeviceBlock(hb.expert, vbank, v.slot * n, hbank, ram.slot * n, copied, release)
