"""combine: sum each token's K weighted expert outputs in a fixed order, finish the layer, add the residual.

The sum runs over k = 0..K-1 of y viewed [T, K, Dx] in that order (kernels/down.py `ordered_sum`; a one-token step of
the fast path sums in the same order inside its down kernel's tail), with no atomics, so
the layer output is bit-identical whatever the schedule, cache size or arrival order. `finish`
is the model's: the latent up-projection for NemotronH, identity for Qwen3-MoE; then the block's shared
term (its shared expert), which route has run already unless its `shared` knob is `late`. The same finish ends the
fast path's one-token step (`launch`: pipeline/plan.py), after the join of its side stream (compute, via: table, has
summed the routed experts there, before the join; where the CPU shares the blocks, its rows replace the zero block's
and the sum runs here, over k in the same order).
"""

from __future__ import annotations

import torch

from sluice.kernels.down import ordered_sum
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import ExpertOutputs, LayerInput, LayerOutput, Routing


class Combine(Stage):
    name = "combine"
    consumes = ("layer", "routing", "expert_outputs")
    produces = "output"

    async def run(self, io: StageIO) -> LayerOutput:
        li: LayerInput = await io.value("layer")
        routing: Routing = await io.value("routing")
        out: ExpertOutputs = await io.value("expert_outputs")
        return LayerOutput(self._finish(li, out.y, routing.shared))

    def _finish(self, li: LayerInput, y, shared):
        """h: the fixed-order sum of y [T*K, Dx] over k, the block's finish and shared term, the residual."""
        T, K = li.x.shape[0], li.block.top_k
        with self.rt.streams.use(self.stream):
            routed = ordered_sum(y.view(T, K, -1), li.x.dtype)
            return li.block.output(li.residual, routed, li.x, shared)

    def launch(self, t):
        block, part = t.block, t.part
        if t.cpu:
            def mixed(v):  # the CPU's rows (cpu_y, where cpu_mask) in place of the zero block's, then the same sum
                with part("combine"):
                    y = torch.where(v["cpu_mask"][:, None], v["cpu_y"], v["y"])
                    routed = ordered_sum(y[None], v["x"].dtype)
                    v["h"] = block.output(v["residual"], routed, v["x"], v.get("shared"))
            return mixed

        def finish(v):  # compute has summed the routed experts (before the join of the shared term's stream)
            with part("combine"):
                v["h"] = block.output(v["residual"], v["routed"], v["x"], v.get("shared"))
        return finish

    def finish(self, v: dict) -> None:
        """A step the host routed (the table stages' host faces: a prompt): the same finish, into h."""
        v["h"] = self._finish(v["li"], v["y"], v["shared"])
