"""The attention module of a model whose small ops are fused (`fused_ops`) where transformers' attention is projections,
per-head norms (or none), rotary embedding, cache update, attention function, output projection: the three input
projections in one (their weights stacked), the norms and the rotation in one launch (kernels/rope.py), the rest the
module's own parts in transformers' order.

transformers calls `apply_rotary_pos_emb` from its modeling file, a module-level function shared by every model of the
family, so the rotation cannot be swapped per model: the module that calls it is (`ATTENTIONS`). Where the kernel does
not take a call's shapes (several sequences on the batch axis, a rotary table in another dtype), the original module
runs it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from sluice.kernels.gemv import linear_add
from sluice.kernels.rope import fits, norm_rope
from sluice.models.base import cache_kw

# transformers' attention classes of this shape -> whether they normalise each query and key head (q_norm, k_norm)
ATTENTIONS = {"Qwen3MoeAttention": True, "MixtralAttention": False}


class NormRopeAttention(nn.Module):
    """Stands where `attn` (an `ATTENTIONS` class) was, with its parts: the same call, the same outputs."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.inner = attn
        self.config, self.layer_idx = attn.config, attn.layer_idx  # what the layer and the rows' calls read of it
        self.norms = ATTENTIONS[type(attn).__name__]
        self.eager = sys.modules[type(attn).__module__].eager_attention_forward  # transformers' default, as the module's
        self.qkv = _merged(attn.q_proj, attn.k_proj, attn.v_proj)  # one launch for three; their weights are views of its
        self.widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.train(attn.training)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                residual: torch.Tensor | None = None, **kwargs):
        """transformers' call; `residual`: returns residual + the attention's output instead, the add in the output
        projection's launch where it is a GEMV (kernels/gemv.py `linear_add`)."""
        a = self.inner
        cache = kwargs.pop("cache", None)
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if self.training or hidden_states.shape[0] != 1:
            return self._theirs(hidden_states, position_embeddings, attention_mask, residual, cache, kwargs)
        if self.qkv is not None:
            q, k, v = self.qkv(hidden_states).split(self.widths, dim=-1)
        else:
            q, k, v = a.q_proj(hidden_states), a.k_proj(hidden_states), a.v_proj(hidden_states)
        heads = (*hidden_states.shape[:-1], -1, a.head_dim)
        q, k, v = q.view(heads), k.view(heads), v.view(heads)
        cos, sin = position_embeddings
        q_w, k_w, eps, round_first = self._norms()
        if not fits(q, k, q_w, k_w, cos, sin, round_first):
            return self._theirs(hidden_states, position_embeddings, attention_mask, residual, cache, kwargs)
        q, k = norm_rope(q, k, q_w, k_w, eps, round_first, cos, sin)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, a.layer_idx, kwargs=kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        out, weights = ALL_ATTENTION_FUNCTIONS.get_interface(a.config._attn_implementation, self.eager)(
            a, q, k, v, attention_mask, dropout=0.0, scaling=a.scaling,
            sliding_window=getattr(a, "sliding_window", getattr(a.config, "sliding_window", None)), **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return (a.o_proj(out) if residual is None else linear_add(a.o_proj, out, residual)), weights

    def _theirs(self, hidden_states, position_embeddings, attention_mask, residual, cache, kwargs):
        """The original module's own call (what the kernel does not take), the residual added after it."""
        out, weights = self.inner(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                  **cache_kw(cache), **kwargs)
        return (out if residual is None else residual + out), weights

    def _norms(self) -> tuple:
        """(q weight, k weight, eps, round_first) of its per-head norms: fused ones (kernels/norm.py RMSNorm) or
        transformers' Llama-form ones; (None, None, 0, False) without."""
        if not self.norms:
            return None, None, 0.0, False
        qn, kn = self.inner.q_norm, self.inner.k_norm
        return qn.weight, kn.weight, qn.variance_epsilon, getattr(qn, "round_first", True)


def _merged(*linears: nn.Module) -> nn.Linear | None:
    """One bias-free nn.Linear whose weight is the linears' weights stacked, each linear's weight made a view of its rows
    (no memory added; a later `.to()` would copy each apart: fused ops are set up on the model already on its device);
    None where they are not all bias-free nn.Linears of one float dtype and device."""
    if not all(type(m) is nn.Linear and m.bias is None and m.weight.is_floating_point() for m in linears):
        return None
    ws = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    merged = nn.Linear(ws[0].shape[1], sum(w.shape[0] for w in ws), bias=False, device="meta")
    merged.weight = nn.Parameter(torch.cat([w.detach() for w in ws]), requires_grad=False)
    for m, part in zip(linears, merged.weight.split([w.shape[0] for w in ws])):
        m.weight = nn.Parameter(part, requires_grad=False)
    return merged


def use_norm_rope(hf_model: nn.Module) -> None:
    """Each attention module of an `ATTENTIONS` class stands replaced by a NormRopeAttention over it, on the transformers
    whose forward it follows (5.2x: layers take the cache as `cache`; an older one keeps its modules)."""
    from sluice.models.build import swap_modules

    if next(iter(cache_kw(None))) != "cache":
        return

    swap_modules(hf_model, lambda m: type(m).__name__ in ATTENTIONS, NormRopeAttention)
