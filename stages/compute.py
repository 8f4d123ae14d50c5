"""compute: the routed experts of each arriving batch of blocks, weighted, into per-(token, k) rows.

Each expert's output for the rows it serves is multiplied by the routing weight and written to
its own rows of y [T*K, Dx]: no accumulation here, so the result does not depend on how blocks
were batched or in which order they arrived (combine sums in a fixed order). The compute stream
waits for each block's copy event; the blocks are released with the event recorded after the
batch, so their slots are not refilled before the kernels have read them.
"""

from __future__ import annotations

import torch

from sluice.kernels.experts_ref import expert_ref
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import ExpertOutputs, LayerInput, Routing


class Compute(Stage):
    name = "compute"
    consumes = ("layer", "routing", "device_blocks")
    produces = "expert_outputs"

    async def run(self, io: StageIO) -> ExpertOutputs:
        li: LayerInput = await io.value("layer")
        r: Routing = await io.value("routing")
        block, streams = li.block, self.rt.streams
        T, K = r.ids.shape
        y = torch.empty(T * K, r.xe.shape[1], dtype=block.combine_dtype, device=r.xe.device)
        w = r.weights.reshape(-1)
        async for batch in io.batches("device_blocks"):
            with streams.use(self.stream):
                for db in batch:
                    streams.wait(self.stream, db.ready)
                for db in batch:
                    rows = r.rows[db.expert]
                    out = expert_ref(block.kind, r.xe[rows // K], db.tensors, block.act)
                    y[rows] = (out * w[rows, None]).to(block.combine_dtype)
                done = streams.record(self.stream)
            for db in batch:
                db.release(done)
        return ExpertOutputs(y)
