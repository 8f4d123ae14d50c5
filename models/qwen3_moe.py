"""Qwen3-MoE: attention then MoE in every sparse layer; SwiGLU experts, fp32 softmax top-k router.

Checkpoint names: model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight are routed
experts (gate/up [I, D], down [D, I]). Layers listed in mlp_only_layers, or off the
decoder_sparse_step grid, have a dense MLP. Everything else is transformers' own decoder layer
(models/decoder.py).
"""

from __future__ import annotations

from sluice.models.base import Architecture, ExpertSpec, ResidentModel, expert_names
from sluice.models.build import build_hf_model
from sluice.models.decoder import DecoderResident, attention_layers_kv, strip_routed, swiglu_block


class Qwen3Moe(Architecture):
    model_type = "qwen3_moe"

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
        return attention_layers_kv(config, dtype_bytes)

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        hf = build_hf_model(self, hf_config, tensors, strip_routed(lambda i: is_sparse(hf_config, i)), device, dtype)
        dt = hf.lm_head.weight.dtype
        return DecoderResident(hf, lambda i: is_sparse(hf_config, i), lambda moe, i, k: swiglu_block(moe, i, k, hf_config, dt),
                               whole_checked=True)  # tests/test_whole.py on an H100, 2026-12-06


def is_sparse(config, i: int) -> bool:
    """transformers' rule (Qwen3MoeDecoderLayer, Qwen3NextDecoderLayer) for which layers have routed experts."""
    return i not in (config.mlp_only_layers or []) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
