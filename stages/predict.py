"""predict: the next MoE layer's router run on this layer's input guesses that layer's experts.

Consecutive layers' inputs differ by a few residual updates, so the next router on the current
input names most of the experts it will pick; fetch reads the guesses into the gap between
layers. Decode only by default (one token, or a batch of decode tokens: their guesses' union): a prompt uses
nearly every expert and would only churn the cache.
Guesses come most likely first (prefetches stop at the first with no room): ranked by routing weight,
summed over a prompt's tokens; a one-token step ranks its K on the host, no tensor ops.

`depth` > 1 also runs the routers of the layers after the next one on this input (the engine passes
them as `LayerInput.ahead`), so reads from a slow drive can start several layers before they are
needed. The guesses grow less likely with distance; the counters score the next layer's (`predicted_right`) apart from
the rest (`further_right`).
All the routers' answers come to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.errors import ScheduleError
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import LayerInput, Prediction


@dataclass(frozen=True)
class PredictKnobs:
    width: int = 0  # guesses to keep per layer, most likely first; 0 keeps the router's top-k
    prefill: bool = False  # also predict for multi-token steps (the union of the tokens' guesses)
    depth: int = 1  # MoE layers guessed ahead: 1 is the next one; more add the layers after it


class Predict(Stage):
    name = "predict"
    consumes = ("layer",)
    produces = "prediction"
    Knobs = PredictKnobs

    @classmethod
    def needs(cls, knobs: PredictKnobs) -> dict:
        return {"depth": knobs.depth}

    def __init__(self, knobs: PredictKnobs, stream: str, rt):
        if knobs.depth < 1:
            raise ScheduleError(f"predict: 'depth' must be >= 1 (the next MoE layer), got {knobs.depth}")
        super().__init__(knobs, stream, rt)

    async def run(self, io: StageIO) -> Prediction:
        li: LayerInput = await io.value("layer")
        nxt = li.next_block
        if nxt is None or (not li.decode and not self.knobs.prefill):
            return Prediction(None, ())
        blocks = (nxt, *li.ahead[: self.knobs.depth - 1])
        streams = self.rt.streams
        with streams.use(self.stream):
            parts = [torch.stack((w.float(), i.float())) for w, i in (b.guessed(li.x) for b in blocks)]
            both = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # one transfer (ids < 2**24 are exact)
        # a one-token step: the guesses into this layer's pinned buffer (Streams.host_buffer)
        host, arrived = streams.to_host(self.stream, both, reuse=("predict", li.block.layer) if li.x.shape[0] == 1 else None)
        await streams.arrived(arrived)
        guesses, at = [], 0
        for b, part in zip(blocks, parts):
            k = part.shape[2]
            guesses.append(self._rank(b, host[:, :, at : at + k]))
            at += k
        for n, (b, g) in enumerate(zip(blocks, guesses)):
            self.rt.stats.observe_prediction(b.layer, g, ahead=n + 1)
        return Prediction(nxt.layer, guesses[0], tuple((b.layer, g) for b, g in zip(blocks[1:], guesses[1:])))

    def _rank(self, block, host: torch.Tensor) -> tuple[int, ...]:
        """A layer's guesses from its router's [2, T, K] (weights, ids) on the host, most likely first."""
        T = host.shape[1]
        width = self.knobs.width or block.top_k * T
        if T == 1:  # one token: its K distinct experts by weight (routers' top-k need not be sorted)
            w, e = host[0, 0].tolist(), host[1, 0].tolist()
            ranked = sorted((-wk, int(ek)) for wk, ek in zip(w, e) if wk > 0)  # as below: ties to the lower id
            return tuple(ek for _, ek in ranked[:width])
        weights, ids = host[0], host[1].long()
        score = torch.zeros(block.num_experts).index_add_(0, ids.flatten(), weights.flatten())
        ranked = torch.argsort(score, descending=True, stable=True)
        ranked = ranked[: int((score > 0).sum())]
        return tuple(ranked[:width].tolist())
