"""Mixtral: attention then a sparse MoE in every layer; SwiGLU experts named w1 (gate), w3 (up), w2 (down).

Checkpoint names: model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight (transformers itself
calls the module `mlp`, and renames block_sparse_moe on load; so do we). Router: softmax top-k,
renormalised.
"""

from __future__ import annotations

import re

from sluice.models.base import Architecture, ExpertSpec, ResidentModel
from sluice.models.build import build_hf_model
from sluice.models.decoder import DecoderResident, attention_layers_kv, strip_routed, swiglu_block


class Mixtral(Architecture):
    model_type = "mixtral"
    renames = ((r"\.block_sparse_moe\.", ".mlp."),)

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="swiglu",
            pattern=re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
                               r"(?P<proj>\w+?)\.(?P<suffix>weight\w*|input_\w+)$"),
            template="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.{suffix}",
            proj_names={"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
            moe_layers=tuple(range(config.num_hidden_layers)),
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
        )

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        return attention_layers_kv(config, dtype_bytes)

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        hf = build_hf_model(self, hf_config, tensors, strip_routed(lambda i: True), device, dtype)
        dt = hf.lm_head.weight.dtype
        return DecoderResident(hf, lambda i: True, lambda moe, i, k: swiglu_block(moe, i, k, hf_config, dt),
                               whole_checked=True)  # tests/test_whole.py on an H100, 2026-12-06
