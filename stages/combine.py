"""combine: sum each token's K weighted expert outputs in a fixed order, finish the layer, add the residual.

The sum runs over k = 0..K-1 of y viewed [T, K, Dx], a fixed-order reduction with no atomics, so
the layer output is bit-identical whatever the schedule, cache size or arrival order. `finish`
is the model's: the latent up-projection for NemotronH, identity for Qwen3-MoE; then the block's shared
term (its shared expert), which route has run already unless its `shared` knob is `late`. The same sum and finish
end the fast path's one-token step (`launch`: pipeline/plan.py), after the join of its side stream.
"""

from __future__ import annotations

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
        T, K = li.x.shape[0], li.block.top_k
        with self.rt.streams.use(self.stream):
            routed = out.y.view(T, K, -1).sum(dim=1).to(li.x.dtype)
            h = li.residual + li.block.output(routed, li.x, routing.shared).view_as(li.residual)
        return LayerOutput(h)

    def launch(self, t):
        block, part, K = t.block, t.part, t.block.top_k

        def finish(v):
            with part("combine"):
                routed = v.get("routed")
                if routed is None:
                    routed = v["y"].view(1, K, -1).sum(dim=1).to(v["x"].dtype)
                v["h"] = v["residual"] + block.output(routed, v["x"], v.get("shared")).view_as(v["residual"])
        return finish

    def finish(self, v: dict) -> None:
        """A step the host routed (a prompt): the fixed-order sum of y [T*K, Dx], the finish and the residual, into h."""
        li = v["li"]
        T, K = li.x.shape[0], li.block.top_k
        with self.rt.streams.use(self.stream):
            routed = v["y"].view(T, K, -1).sum(dim=1).to(li.x.dtype)
            v["h"] = li.residual + li.block.output(routed, li.x, v["shared"]).view_as(li.residual)
