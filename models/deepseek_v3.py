"""DeepSeek-V3: multi-head latent attention (MLA), dense MLPs in the first `first_k_dense_replace`
layers, then MoE layers with shared experts and a grouped sigmoid router (correction bias,
group-limited top-k, normalised, scaled); FP8 128x128 block-scaled weights read as stored.

Checkpoint names: model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight (+ weight_scale_inv).
Multi-token-prediction layers (index >= num_hidden_layers) are not part of the LM and are skipped.
"""

from __future__ import annotations

from sluice.models.base import Architecture, ExpertSpec, ResidentModel, expert_names
from sluice.models.build import build_hf_model
from sluice.models.decoder import DecoderResident, strip_routed, swiglu_block


class DeepseekV3(Architecture):
    model_type = "deepseek_v3"

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="swiglu",
            **expert_names("model.", "mlp.experts"),
            proj_names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
            moe_layers=tuple(range(config.first_k_dense_replace, config.num_hidden_layers)),
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
        )

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        """MLA's compressed latent (kv_lora_rank + the decoupled RoPE key) per layer: what an MLA cache holds.
        (transformers' own DynamicCache keeps decompressed keys and values, which Sluice uses today.)"""
        return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        sparse = lambda i: i >= hf_config.first_k_dense_replace  # noqa: E731 - transformers' DeepseekV3DecoderLayer rule
        hf = build_hf_model(self, hf_config, tensors, strip_routed(sparse), device, dtype)
        dt = hf.lm_head.weight.dtype

        return DecoderResident(hf, sparse, lambda moe, i, k: swiglu_block(moe, i, k, hf_config, dt, shared=moe.shared_experts),
                               whole_checked=True)  # tests/test_whole.py on an H100, 2026-12-06
