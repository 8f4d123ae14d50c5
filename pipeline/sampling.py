"""Token sampling: greedy at temperature 0, else temperature + top-p (nucleus) with a seeded generator."""

from __future__ import annotations

import torch

from sluice.errors import SluiceError


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
        if not temperature >= 0:
            raise SluiceError(f"temperature must be >= 0, got {temperature!r}")
        if not 0 < top_p <= 1:
            raise SluiceError(f"top_p must be in (0, 1], got {top_p!r}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (any device) -> token id."""
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            p, idx = torch.sort(probs, descending=True, stable=True)
            keep = torch.cumsum(p, 0) - p < self.top_p  # smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).index_copy_(0, idx[keep], p[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))
