"""One decode step over several sequences: each MoE layer runs once over all their rows.

The tokens of B sequences in one MoE layer route to the union of their experts, so each block read or copied
serves every row that routed to it (expert bytes per generated token fall as sequences are added). Resident layers
(attention, Mamba-2, dense MLPs) run per sequence on its own cache, as a one-token step does, but eagerly: their
one-token graphs are keyed by one sequence's state. The MoE layer gets the rows as one prompt-like step (T = B), so
its experts run as grouped kernels and each row is combined in the same fixed order as alone; logits agree with
one-at-a-time decode within the kernels' rounding (a row's sums are grouped differently), not bit for bit.
"""

from __future__ import annotations

import torch

from sluice.errors import SluiceError


async def step_many(engine, seqs: list, tokens: list[int]) -> list[torch.Tensor]:
    """Append tokens[b] to seqs[b] for every b in one step; each sequence's logits [1, V] fp32 on the device."""
    model, coordinator, recorder = engine.model, engine.coordinator, engine.rt.recorder
    if recorder is not None:
        recorder.begin_step(len(seqs))
    with torch.inference_mode():
        begun = [model.begin(torch.tensor([[t]], device=engine.device), s.cache, len(s.tokens)) for s, t in zip(seqs, tokens)]
        hs, ctxs = [h for h, _ in begun], [c for _, c in begun]
        for layer in model.layers:
            if layer.moe is None:
                hs = [layer.forward(h, ctx) for h, ctx in zip(hs, ctxs)]
            else:
                hs = await coordinator.moe_rows(layer, hs, ctxs)
        logits = [model.head(h) for h in hs]
        if engine.routing is not None:
            engine.routing.advance(len(seqs))
    for s, t in zip(seqs, tokens):
        s.tokens.append(t)
    if recorder is not None:
        recorder.end_step()
    engine.rt.stats.steps += 1
    engine.rt.stats.tokens += len(seqs)
    engine.rt.tracer.flush()
    return logits


def check_batch(model, seqs: list, tokens: list[int], limit: int | None) -> None:
    """A model whose steps may share a layer's pass; one token per sequence, distinct sequences, none broken, none
    past a static cache."""
    if not model.batchable:
        raise SluiceError(f"extend_many: {model.config.model_type} keeps one sequence's state between a layer's parts; "
                          f"decode its sequences one at a time")
    if len(seqs) != len(tokens) or not seqs:
        raise SluiceError(f"extend_many: one token per sequence, got {len(tokens)} tokens for {len(seqs)} sequences")
    if len({id(s) for s in seqs}) != len(seqs):
        raise SluiceError("extend_many: a sequence appears twice in one step")
    for s in seqs:
        if s.broken:
            raise SluiceError("this sequence's state was lost by an earlier failed step; start a new one")
        if not s.tokens:
            raise SluiceError("extend_many decodes: each sequence needs its prompt first (extend)")
        if limit is not None and len(s.tokens) + 1 > limit:
            raise SluiceError(f"a sequence would hold {len(s.tokens) + 1} tokens, more than the static_kv cache's {limit} "
                              f"(--static-kv)")
