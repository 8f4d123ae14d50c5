"""Several sequences' tokens through one layer in one call (pipeline/batch.py's shared steps).

Their rows are packed along the token axis into one [1, sum(T_b), D] input, so the layer's norms, projections and
rotary read their weights once for every sequence. What mixes tokens runs per sequence on its own state: the cache
update and the attention of an attention layer, through `RowsCache` (standing in the layer's cache) and
`rows_attention` (switched in as the model's attention function for the call), which calls the model's own attention
function once per sequence with that sequence's keys, values and mask. Per-token arithmetic is unchanged; the
projections' matmuls see more rows, so their sums may round differently (as the MoE layer's grouped kernels do).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from sluice.models.base import cache_kw

ROWS = "sluice_rows"  # the attention function's name in transformers' registry, and its keyword


@dataclass(frozen=True)
class Rows:
    """The sequences of one packed call, in order."""

    caches: tuple  # each sequence's own cache (transformers' Cache)
    lengths: tuple[int, ...]  # each sequence's tokens in the packed input
    masks: tuple  # each sequence's attention mask for the layer called (None: it attends to all it holds)
    implementation: str  # the model's own attention function (`config._attn_implementation`), called per sequence


class RowsCache:
    """Stands in a layer's cache for one packed call: each sequence's own cache updated with its tokens' keys and
    values, and what the caches hold given back joined along the tokens, as one sequence's would be (a copy: the
    price of letting the layer treat them as its own, e.g. DeepSeek-V3 expanding its cached latents after the update);
    `rows_attention` splits them again at `held`."""

    def __init__(self, rows: Rows):
        self.rows = rows
        self.held: tuple[int, ...] | None = None  # each sequence's cached tokens, after the update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n = self.rows.lengths
        kv = [cache.update(k, v, layer_idx, *args, **kwargs) for cache, k, v
              in zip(self.rows.caches, key_states.split(n, dim=-2), value_states.split(n, dim=-2))]
        self.held = tuple(k.shape[-2] for k, _ in kv)
        return torch.cat([k for k, _ in kv], dim=-2), torch.cat([v for _, v in kv], dim=-2)


def rows_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's attention function per sequence: its queries (of the packed query [1, H, sum(T_b), d]) over its own
    cache's keys and values (of the joined ones), with its own mask; the outputs [1, T_b, H, d] joined again."""
    cache: RowsCache = kwargs.pop(ROWS)
    rows = cache.rows
    if cache.held is None:
        raise RuntimeError(f"{type(module).__name__}: a packed call whose attention did not update its cache")
    own = _implementation(module, rows.implementation)
    positions = kwargs.pop("position_ids", None)
    per_row = positions.split(rows.lengths, dim=-1) if positions is not None else [None] * len(rows.lengths)
    outs = [own(module, q, k, v, mask, position_ids=p, **kwargs)[0]
            for q, k, v, mask, p in zip(query.split(rows.lengths, dim=2), key.split(cache.held, dim=-2),
                                        value.split(cache.held, dim=-2), rows.masks, per_row)]
    return torch.cat(outs, dim=1), None


def _implementation(module, name: str):
    """transformers' attention function `name` as `module` would call it (`eager`: its modeling file's own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager" or name is None:
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


@contextmanager
def attention_per_row(config):
    """config's attention function switched to `rows_attention` for one packed call (the layers read it each call),
    its own restored after; yields its own name."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if ROWS not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ROWS, rows_attention)
    own = config._attn_implementation
    config._attn_implementation = ROWS
    try:
        yield own
    finally:
        config._attn_implementation = own


def packed_call(call, attention, hs: list[torch.Tensor], ctxs: list, layer_type: str, **kw) -> torch.Tensor:
    """call(h, **kwargs) (a transformers decoder layer or block) once over the rows hs [1, T_b, D] packed into one, with
    each sequence's positions and, where `attention` (the layer's attention module) is not None, its attention per
    sequence; the packed output [1, sum(T_b), D]."""
    h = torch.cat(hs, dim=1)
    kwargs = {**_joined(ctxs, packed=True), **kw}
    if attention is None:
        return _first(call(h, **kwargs))
    with attention_per_row(attention.config) as own:
        rows = Rows(tuple(c.cache for c in ctxs), tuple(x.shape[1] for x in hs),
                    tuple(c.masks.get(layer_type) for c in ctxs), own)
        cache = RowsCache(rows)
        return _first(call(h, **kwargs, **cache_kw(cache), **{ROWS: cache}))


def _joined(ctxs: list, packed: bool) -> dict[str, Any]:
    """A layer call's keywords for several sequences' steps: their positions joined along the tokens (`packed`) or the
    batch axis (position ids [1, T], or [3, 1, T] for a multimodal rotary; rotary tables [1, T, d]); masks per
    sequence are the attention function's."""
    ids, tables = (-1, -2) if packed else (-2, -3)
    kwargs: dict[str, Any] = dict(attention_mask=None, position_ids=torch.cat([c.position_ids for c in ctxs], dim=ids),
                                  use_cache=True)
    pe = [c.position_embeddings for c in ctxs]
    if pe[0] is not None:
        kwargs["position_embeddings"] = tuple(torch.cat(parts, dim=tables) for parts in zip(*pe))
    return kwargs


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class RowsStates:
    """Stands in a linear-attention (DeltaNet) layer's cache for one call over R sequences' one-token steps, batched
    along the batch axis: their conv and recurrent states gathered [R, ...] (a copy: the caches hold them apart), the
    layer's in-place and returned updates put back into each sequence's own cache after the call (`put_back`)."""

    def __init__(self, caches: list, layer_idx: int):
        self.caches, self.layer_idx = caches, layer_idx
        self.conv = torch.cat([c.get_conv_state(layer_idx) for c in caches])
        self.recurrent = torch.cat([c.get_recurrent_state(layer_idx) for c in caches])

    @staticmethod
    def takes(caches: list, layer_idx: int) -> bool:
        """Whether every cache holds this layer's states from an earlier step, as transformers' one-token path needs
        (a cache recording past states for snapshots, or of a transformers without these calls, goes one at a time)."""
        need = ("get_conv_state", "get_recurrent_state", "update_recurrent_state", "increase_count", "is_recording_past")
        return all(all(hasattr(c, n) for n in need) and c.has_previous_state(layer_idx) and not c.is_recording_past(layer_idx)
                   for c in caches)

    def get_conv_state(self, layer_idx, state_idx=0):
        return self._mine(layer_idx, state_idx, self.conv)

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self._mine(layer_idx, state_idx, self.recurrent)

    def is_recording_past(self, layer_idx):
        return False

    def increase_count(self, layer_idx, state_idx=0):
        for c in self.caches:
            c.increase_count(layer_idx, state_idx)

    def update_recurrent_state(self, states, layer_idx, state_idx=0, **kwargs):
        self.recurrent = self._mine(layer_idx, state_idx, states)
        return states

    def put_back(self) -> None:
        for b, c in enumerate(self.caches):
            c.get_conv_state(self.layer_idx).copy_(self.conv[b : b + 1])
            c.update_recurrent_state(self.recurrent[b : b + 1], self.layer_idx)

    def _mine(self, layer_idx, state_idx, value):
        if layer_idx != self.layer_idx or state_idx != 0:
            raise RuntimeError(f"a batched DeltaNet step asked for layer {layer_idx} state {state_idx}, holds layer {self.layer_idx}'s")
        return value


def recurrent_rows(call, layer_idx: int, hs: list[torch.Tensor], ctxs: list) -> torch.Tensor:
    """call(h, **kwargs) (a transformers decoder layer with a linear-attention mixer) once over R sequences' one-token
    steps hs [1, 1, D] batched along the batch axis [R, 1, D], each on its own states (`RowsStates`); the output
    [R, 1, D]."""
    states = RowsStates([c.cache for c in ctxs], layer_idx)
    out = _first(call(torch.cat(hs), **_joined(ctxs, packed=False), **cache_kw(states)))
    states.put_back()
    return out
