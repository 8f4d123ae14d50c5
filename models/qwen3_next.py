"""Qwen3-Next: Gated DeltaNet (linear attention) and gated full-attention layers, each followed by a
MoE with a sigmoid-gated shared expert: out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x).

Checkpoint names as Qwen3-MoE: model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight.
The DeltaNet layers' conv and recurrent states live in transformers' cache like Mamba's.
"""

from __future__ import annotations

import torch

from sluice.models.base import MoEBlock, ResidentModel
from sluice.models.build import build_hf_model
from sluice.models.decoder import DecoderResident, attention_layers_kv, strip_routed, swiglu_block
from sluice.models.qwen3_moe import Qwen3Moe, is_sparse


class Qwen3Next(Qwen3Moe):
    """Routed experts named and placed as in Qwen3-MoE (its expert_spec); mixers and the shared expert differ."""

    model_type = "qwen3_next"

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        return attention_layers_kv(config, dtype_bytes, sum(t == "full_attention" for t in config.layer_types))

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
        hf = build_hf_model(self, hf_config, tensors, strip_routed(lambda i: is_sparse(hf_config, i)), device, dtype)
        dt = hf.lm_head.weight.dtype
        return DecoderResident(hf, lambda i: is_sparse(hf_config, i), lambda moe, i, k: gated_shared_block(moe, i, k, hf_config, dt))


def gated_shared_block(moe, layer_idx: int, moe_index: int, config, dtype: torch.dtype) -> MoEBlock:
    """swiglu_block finished by the sigmoid-gated shared expert: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
    def shared(x):  # the modules looked up per call: fuse_linears may replace them
        return torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)

    return swiglu_block(moe, layer_idx, moe_index, config, dtype, shared=shared)
