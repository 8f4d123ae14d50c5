"""h2d: RAM slot -> VRAM slot on the schedule's stream, one event per block.

On a CPU there is nothing to copy: compute reads the pinned RAM slot in place, and the RAM pin
is held until compute releases the block. On CUDA each block is copied (non-blocking, from
pinned memory) into a slot of the VRAM bank; the RAM pin is dropped as soon as the copy is
enqueued, with the copy's event attached so the slot is not refilled before the copy has read
it. When the VRAM bank has no free slot the stage ends a wave and waits for compute to release one.
"""

from __future__ import annotations

from sluice.stages.base import Stage, StageIO
from sluice.stages.types import DeviceBlock, HostBlock


class H2D(Stage):
    name = "h2d"
    consumes = ("layer", "blocks")
    produces = "device_blocks"
    channel = True

    async def run(self, io: StageIO) -> None:
        layer = (await io.value("layer")).block.layer
        async for batch in io.batches("blocks"):
            for hb in batch:
                io.emit(await self._place(io, layer, hb))
            io.end_wave()  # pass the upstream wave boundary on

    async def _place(self, io: StageIO, layer: int, hb: HostBlock) -> DeviceBlock:
        rt = self.rt
        if hb.vram is not None:
            v = hb.vram
            return DeviceBlock(hb.expert, rt.views(v.buf), v.filled, lambda done, v=v: rt.vram.unpin(v, done))
        if rt.vram is None:
            e = hb.ram
            return DeviceBlock(hb.expert, rt.views(e.buf), None, lambda done, e=e: rt.ram.unpin(e, done))
        key = (layer, hb.expert)
        v = rt.vram.try_reserve(key)
        if v is None:
            io.end_wave()
            v = await rt.vram.reserve(key)
        streams = rt.streams
        with streams.use(self.stream):
            streams.wait(self.stream, v.reuse_after)
            v.buf.copy_(hb.ram.buf, non_blocking=True)
            copied = streams.record(self.stream)
        v.reuse_after = None
        v.filled = copied
        rt.ram.unpin(hb.ram, copied)
        return DeviceBlock(hb.expert, rt.views(v.buf), copied, lambda done, v=v: rt.vram.unpin(v, done))
