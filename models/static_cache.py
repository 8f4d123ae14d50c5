"""Attention over a static cache (`--static-kv N`) read through a window: the first W slots, W the power of two (at
least MIN_WINDOW, at most N) that holds every token the sequence has, not all N. Its slots are allocated as the
sequence needs them: FIRST_SLOTS at first, doubled (what they hold copied over) when a step would outgrow them, up to N.

transformers' StaticCache preallocates N slots per attention layer and attends over all of them, masking the empty
ones, so a one-token step reads N slots of keys and values whatever the sequence holds (a 4096-slot cache made the
attention of an all-VRAM Nemotron-3-Nano token cost more than its routed experts). Read through a window, a step
reads at most twice what the sequence holds; the window's size is fixed between powers of two, so a step captured as
a CUDA graph (pipeline/whole.py, which keys its graphs by it) replays until the sequence outgrows it. The empty slots
the window leaves out were masked: the same tokens are attended, and only the attention kernel's tiling changes. A
cache that grows gets new tensors, so a whole step captured over the old ones is captured again (its state key names
them).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticLayer

from sluice.kernels.kv_append import appendable, kv_append

MIN_WINDOW = 256
FIRST_SLOTS = 1024  # a static cache's attention slots until its sequence needs more (at most its N)


class WindowedLayer(StaticLayer):
    """A StaticLayer whose update hands attention its first `window` slots (set by `fit`) and whose mask is as long;
    it holds `max_cache_len` slots, grown by `fit` up to `limit`."""

    window: int
    limit: int

    def update(self, key_states, value_states, *args, **kwargs):
        length = getattr(self, "cumulative_length", None)
        if (key_states.is_cuda and getattr(self, "is_initialized", False) and isinstance(length, torch.Tensor)
                and appendable(self.keys, self.values, key_states, value_states)):
            kv_append(self.keys, self.values, key_states, value_states, length)  # one launch for transformers' five
            keys, values = self.keys, self.values
        else:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys[:, :, : self.window], values[:, :, : self.window]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.window, 0


def windowed(cache: Any) -> Any:
    """`cache` (a StaticCache) with its full-attention layers read through windows; sliding layers stay as they are."""
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            layer.__class__ = WindowedLayer
            layer.limit = layer.max_cache_len
            _grow(layer, min(FIRST_SLOTS, layer.limit))  # before the lazy allocation of its first update, where there is one
            layer.window = min(MIN_WINDOW, layer.max_cache_len)
    return cache


def fit(cache: Any, tokens: int) -> int:
    """Before a step after which the sequence holds `tokens` tokens: each windowed layer's window made to hold them.
    Returns the window (0 for a cache without windowed layers)."""
    window, power = 0, 1 << max(0, tokens - 1).bit_length()
    for layer in cache.layers:
        if isinstance(layer, WindowedLayer):
            if tokens > layer.max_cache_len:
                _grow(layer, min(getattr(layer, "limit", layer.max_cache_len), power))
            layer.window = window = min(layer.max_cache_len, max(MIN_WINDOW, power))
    return window


def grown(cache: Any) -> bool:
    """Whether a windowed layer of `cache` holds more than its first slots (a long sequence's)."""
    return any(isinstance(layer, WindowedLayer) and layer.max_cache_len > min(FIRST_SLOTS, layer.limit)
               for layer in cache.layers)


def _grow(layer: StaticLayer, slots: int) -> None:
    """The layer's slots made `slots`: its key and value tensors, if allocated, replaced by ones that long holding
    what they held."""
    for name in ("keys", "values"):
        old = getattr(layer, name, None)
        if isinstance(old, torch.Tensor) and old.dim() == 4 and old.shape[2] != slots:
            new = old.new_zeros(*old.shape[:2], slots, old.shape[3])
            n = min(slots, old.shape[2])
            new[:, :, :n] = old[:, :, :n]
            setattr(layer, name, new)
    layer.max_cache_len = slots
