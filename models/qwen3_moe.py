"""Qwen3-MoE: attention then MoE in every sparse layer; SwiGLU experts, fp32 softmax top-k router.

Checkpoint names: model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight are routed
experts (gate/up [I, D], down [D, I]). Layers listed in mlp_only_layers, or off the
decoder_sparse_step grid, have a dense MLP and run whole as transformers' decoder layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sluice.models.base import (
    Architecture,
    ExpertSpec,
    Layer,
    MoEBlock,
    ResidentModel,
    StreamedExperts,
    attention_kv_bytes,
    build_hf_model,
    cache_kw,
    default_expert_pattern,
)


class Qwen3Moe(Architecture):
    model_type = "qwen3_moe"

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="swiglu",
            pattern=default_expert_pattern("model.", "mlp.experts"),
            proj_names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
            moe_layers=tuple(i for i in range(config.num_hidden_layers) if _is_sparse(config, i)),
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
        )

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return attention_kv_bytes(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype_bytes)

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        def strip(model: nn.Module) -> None:
            for i, layer in enumerate(model.model.layers):
                if _is_sparse(hf_config, i):
                    layer.mlp.experts = StreamedExperts()

        return Qwen3MoeResident(build_hf_model(self, hf_config, tensors, strip, device, dtype))


def _is_sparse(config, i: int) -> bool:
    """transformers' rule (Qwen3MoeDecoderLayer) for which layers have routed experts."""
    return i not in (config.mlp_only_layers or []) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0


class _Ctx:
    __slots__ = ("cache", "position_ids", "mask", "position_embeddings")

    def __init__(self, cache, position_ids, mask, position_embeddings):
        self.cache, self.position_ids = cache, position_ids
        self.mask, self.position_embeddings = mask, position_embeddings


def _attn_kwargs(ctx: _Ctx) -> dict:
    return dict(
        attention_mask=ctx.mask,
        position_ids=ctx.position_ids,
        use_cache=True,
        position_embeddings=ctx.position_embeddings,
        **cache_kw(ctx.cache),
    )


class _DenseLayer(Layer):
    def __init__(self, layer):
        self.layer = layer

    def forward(self, h, ctx):
        return self.layer(h, **_attn_kwargs(ctx))


class _MoELayer(Layer):
    """transformers' Qwen3MoeDecoderLayer.forward up to its MLP; the MLP is the stage graph."""

    def __init__(self, layer, layer_idx: int, moe_index: int, config):
        from transformers.activations import ACT2FN

        self.layer = layer
        gate = layer.mlp.gate
        self.moe = MoEBlock(
            layer=layer_idx,
            index=moe_index,
            kind="swiglu",
            top_k=config.num_experts_per_tok,
            num_experts=config.num_experts,
            router=lambda x: gate(x)[1:],
            expert_input=lambda x: x,
            finish=lambda routed, x: routed,
            act=ACT2FN[config.hidden_act],
            act_name=config.hidden_act,
            weight_dtype=layer.input_layernorm.weight.dtype,
            combine_dtype=layer.input_layernorm.weight.dtype,
        )

    def moe_input(self, h, ctx):
        layer = self.layer
        residual = h
        x = layer.input_layernorm(h)
        x, _ = layer.self_attn(hidden_states=x, **_attn_kwargs(ctx))
        h = residual + x
        x = layer.post_attention_layernorm(h)
        return x.view(-1, x.shape[-1]), h


class Qwen3MoeResident(ResidentModel):
    def __init__(self, hf_model):
        super().__init__(hf_model)
        self.layers = []
        moe_index = 0
        for i, layer in enumerate(hf_model.model.layers):
            if _is_sparse(self.config, i):
                self.layers.append(_MoELayer(layer, i, moe_index, self.config))
                moe_index += 1
            else:
                self.layers.append(_DenseLayer(layer))

    def begin(self, ids, cache, past) -> tuple[torch.Tensor, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        model = self.hf.model
        h = model.embed_tokens(ids)
        position_ids = (torch.arange(ids.shape[1], device=ids.device) + past).unsqueeze(0)
        mask_fn = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
        mask = mask_fn(config=self.config, inputs_embeds=h, attention_mask=None, position_ids=position_ids, **cache_kw(cache))
        return h, _Ctx(cache, position_ids, mask, model.rotary_emb(h, position_ids=position_ids))

    def head(self, h):
        return self.hf.lm_head(self.hf.model.norm(h)[0]).float()
