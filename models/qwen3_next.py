"""Qwen3-Next: Gated DeltaNet (linear attention) and gated full-attention layers, each followed by a
MoE with a sigmoid-gated shared expert: out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x).

Checkpoint names as Qwen3-MoE: model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight.
The DeltaNet layers' conv and recurrent states live in transformers' cache like Mamba's.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.models.base import Architecture, ExpertSpec, ResidentModel, StreamedExperts, attention_kv_bytes, build_hf_model, expert_names
from sluice.models.decoder import DecoderResident, swiglu_block
from sluice.models.qwen3_moe import is_sparse


class Qwen3Next(Architecture):
    model_type = "qwen3_next"

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="swiglu",
            **expert_names("model.", "mlp.experts"),
            proj_names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
            moe_layers=tuple(i for i in range(config.num_hidden_layers) if is_sparse(config, i)),
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
        )

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        n = sum(t == "full_attention" for t in config.layer_types)
        return attention_kv_bytes(n, config.num_key_value_heads, config.head_dim, dtype_bytes)

    def recurrent_bytes(self, config, dtype_bytes: int) -> int:
        """Per DeltaNet layer: the conv state over q, k, v channels (kernel wide) and the recurrent state
        (value heads x key dim x value dim, fp32)."""
        n = sum(t == "linear_attention" for t in config.layer_types)
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        conv = (2 * key_dim + value_dim) * config.linear_conv_kernel_dim * dtype_bytes
        rec = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return n * (conv + rec)

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        def strip(model: nn.Module) -> None:
            for i, layer in enumerate(model.model.layers):
                if is_sparse(hf_config, i):
                    layer.mlp.experts = StreamedExperts()

        hf = build_hf_model(self, hf_config, tensors, strip, device, dtype)
        dt = hf.lm_head.weight.dtype

        def block(moe, i, k):
            shared, gate = moe.shared_expert, moe.shared_expert_gate
            return swiglu_block(moe, i, k, hf_config, dt, finish=lambda routed, x: routed + torch.sigmoid(gate(x)) * shared(x))

        return DecoderResident(hf, lambda i: is_sparse(hf_config, i), block)
