"""The attention function of a model whose small ops are fused (`fused_ops`): a one-token step's attention in one
launch on a GPU (kernels/attention.py), everything else through transformers' SDPA function as before.

It is registered in transformers' attention and mask registries under `NAME` (masks are SDPA's), and the model's
config names it, as models/rows.py switches in its per-sequence attention for a packed call.
"""

from __future__ import annotations

from typing import Any

from sluice.kernels.attention import fits, one_query_attention

NAME = "sluice_sdpa"


def sdpa_one_query(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """transformers' attention function signature: (output [B, T, Hq, D], None)."""
    if (_runs_here(query) and not dropout and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and kwargs.get("position_bias") is None and fits(query, key, value, attention_mask)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return one_query_attention(query, key, value, attention_mask, scale), None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)


def _runs_here(query) -> bool:
    """Where the kernel runs: on a GPU (Triton's interpreter is for the tests)."""
    return query.is_cuda


def use_one_query_attention(hf_model: Any) -> None:
    """hf_model's SDPA attention through `sdpa_one_query` (a model on another attention function keeps it)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if hf_model.config._attn_implementation != "sdpa":
        return
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, sdpa_one_query)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    hf_model.config._attn_implementation = NAME
