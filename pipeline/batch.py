"""One step over several sequences (decode tokens, and prompt pieces beside them): each MoE layer runs once over
all their rows.

The tokens of B sequences in one MoE layer route to the union of their experts, so each block read or copied
serves every row that routed to it (expert bytes per generated token fall as sequences are added). A resident
layer takes the rows in one call where it can (`Layer.forward_rows`): an attention or MLP block over the rows packed
together, each sequence's attention over its own cache (models/rows.py); a Mamba-2 block's projections over every
decode row and its conv and SSM step over all their states at once; a DeltaNet layer its decode rows over their
gathered states. What cannot (a Mamba-2 or DeltaNet layer's prompt pieces) runs per sequence on its own cache, as
alone. A step of decode tokens alone replays whole as one graph over these sequences' states where a one-token
step would (pipeline/whole.py `run_rows`, from their second such step); other steps run layer by layer here. The MoE
layer gets the rows as one prompt-like step (T = B), so its experts run as grouped kernels and each row is combined
in the same fixed order as alone; logits agree with one-at-a-time decode within the kernels' rounding (a row's sums
are grouped differently), not bit for bit.
"""

from __future__ import annotations

import torch

from sluice.errors import SluiceError
from sluice.pipeline.whole import resident_rows


async def step_many(engine, seqs: list, pieces: list[list[int]]) -> list[torch.Tensor]:
    """Append pieces[b] (a decode token, or a piece of a prompt) to seqs[b] for every b in one step; each sequence's
    last-position logits [1, V] fp32 on the device."""
    model, coordinator, recorder = engine.model, engine.coordinator, engine.rt.recorder
    rows = sum(len(p) for p in pieces)
    if recorder is not None:
        recorder.begin_step(rows)
    with torch.inference_mode():
        whole = engine.whole if rows == len(seqs) and all(s.tokens for s in seqs) else None
        logits = whole.run_rows(seqs, [p[0] for p in pieces]) if whole is not None else None
        if logits is None:
            for s in seqs:
                s.state_key = None  # a step layer by layer may place a state anew (pipeline/whole.py looks it up again)
            begun = [model.begin(torch.tensor([p], device=engine.device), s.cache, len(s.tokens)) for s, p in zip(seqs, pieces)]
            hs, ctxs = [h for h, _ in begun], [c for _, c in begun]
            for layer in model.layers:
                hs = resident_rows(layer, hs, ctxs) if layer.moe is None else await coordinator.moe_rows(layer, hs, ctxs)
            logits = [model.head(h[:, -1:]) for h in hs]
            if engine.routing is not None:
                engine.routing.advance(rows)
    for s, p in zip(seqs, pieces):
        s.tokens.extend(p)
    if recorder is not None:
        recorder.end_step()
    engine.rt.stats.steps += 1
    engine.rt.stats.tokens += rows
    engine.rt.tracer.flush()
    return logits


def check_batch(model, seqs: list, pieces: list[list[int]], limit: int | None) -> None:
    """A model whose steps may share a layer's pass; a non-empty piece per sequence, distinct sequences, each with
    room for its piece (`Sequence.check`)."""
    if not model.batchable:
        raise SluiceError(f"extend_many: {model.config.model_type} keeps one sequence's state between a layer's parts; "
                          f"decode its sequences one at a time")
    if len(seqs) != len(pieces) or not seqs:
        raise SluiceError(f"extend_many: one piece per sequence, got {len(pieces)} for {len(seqs)} sequences")
    if not all(pieces) or not all(isinstance(i, int) and not isinstance(i, bool) for p in pieces for i in p):
        raise SluiceError("extend_many: each sequence's piece is a non-empty list of token ids")
    if len({id(s) for s in seqs}) != len(seqs):
        raise SluiceError("extend_many: a sequence appears twice in one step")
    for s, p in zip(seqs, pieces):
        s.check(p, limit, model.vocab)
