"""predict: the next MoE layer's router run on this layer's input guesses that layer's experts.

Consecutive layers' inputs differ by a few residual updates, so the next router on the current
input names most of the experts it will pick; fetch reads the guesses into the gap between
layers. Decode only by default: a prompt uses nearly every expert and would only churn the cache.
Guesses come most likely first (prefetches stop at the first with no room): ranked by routing weight,
summed over a prompt's tokens; a one-token step ranks its K on the host, no tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.stages.base import Stage, StageIO
from sluice.stages.types import LayerInput, Prediction


@dataclass(frozen=True)
class PredictKnobs:
    width: int = 0  # guesses to keep, most likely first; 0 keeps the router's top-k
    prefill: bool = False  # also predict for multi-token steps (the union of the tokens' guesses)


class Predict(Stage):
    name = "predict"
    consumes = ("layer",)
    produces = "prediction"
    Knobs = PredictKnobs

    async def run(self, io: StageIO) -> Prediction:
        li: LayerInput = await io.value("layer")
        nxt = li.next_block
        if nxt is None or (li.x.shape[0] > 1 and not self.knobs.prefill):
            return Prediction(None, ())
        width = self.knobs.width or nxt.top_k * (1 if li.x.shape[0] == 1 else li.x.shape[0])
        streams = self.rt.streams
        with streams.use(self.stream):
            weights, ids = nxt.router(li.x)
            both = torch.stack((weights.float(), ids.float()))  # one transfer (ids < 2**24 are exact)
        host, arrived = streams.to_host(self.stream, both)
        await streams.arrived(arrived)
        if li.x.shape[0] == 1:  # one token: its K distinct experts by weight (routers' top-k need not be sorted)
            w, e = host[0, 0].tolist(), host[1, 0].tolist()
            ranked = sorted((-wk, int(ek)) for wk, ek in zip(w, e) if wk > 0)  # as below: ties to the lower id
            guesses = tuple(ek for _, ek in ranked[:width])
            self.rt.stats.observe_prediction(nxt.layer, guesses)
            return Prediction(nxt.layer, guesses)
        weights, ids = host[0], host[1].long()
        score = torch.zeros(nxt.num_experts).index_add_(0, ids.flatten(), weights.flatten())
        ranked = torch.argsort(score, descending=True, stable=True)
        ranked = ranked[: int((score > 0).sum())]
        guesses = tuple(ranked[:width].tolist())
        self.rt.stats.observe_prediction(nxt.layer, guesses)
        return Prediction(nxt.layer, guesses)
