"""gpt-oss: attention (sliding-window and full layers alternating, learned sinks) then a MoE in every
layer. Router: a biased linear, softmax over the top-k logits. Experts: SwiGLU with biases and a
clamped gate, h = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g) with g = min(gate, L).

Checkpoint names: each layer's experts are fused into one tensor per kind,
    model.layers.L.mlp.experts.gate_up_proj_blocks   U8 [E, 2I, D/32, 16]  MXFP4 (E2M1 nibbles, low first)
    model.layers.L.mlp.experts.gate_up_proj_scales   U8 [E, 2I, D/32]      E8M0, one per 32 inputs
    model.layers.L.mlp.experts.gate_up_proj_bias        [E, 2I]
    model.layers.L.mlp.experts.down_proj_{blocks,scales,bias}  [E, D, I/32, 16], [E, D, I/32], [E, D]
with gate and up rows interleaved (row 2j is gate j, row 2j+1 up j). Unquantised checkpoints hold
gate_up_proj [E, D, 2I] and down_proj [E, I, D], i.e. [in, out]. `split_fused` cuts them into
per-expert parts, gate apart from up, [out, in]: byte permutations, so the store keeps the
checkpoint's own values.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from sluice.models.base import Architecture, ExpertSpec, MoEBlock, ResidentModel
from sluice.models.build import build_hf_model
from sluice.models.decoder import DecoderResident, MoECapture, attention_layers_kv, strip_routed
from sluice.storage.safetensors_io import TensorInfo, TensorPart

ALPHA = 1.702  # transformers' GptOssExperts.alpha
_FUSED = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)(?:_(?P<suffix>blocks|scales|bias))?$")
_SUFFIXES = {None: "weight", "blocks": "weight", "scales": "weight_scale", "bias": "bias"}


def split_fused(name: str, info: TensorInfo) -> list[tuple[int, int, str, str, TensorPart]] | None:
    """A fused expert tensor's per-expert parts: (layer, expert, proj, suffix, part); None for other tensors."""
    m = _FUSED.match(name)
    if m is None:
        return None
    layer, suffix = int(m["layer"]), _SUFFIXES[m["suffix"]]
    transpose = m["suffix"] is None  # unquantised weights are stored [in, out]
    experts = range(info.shape[0])
    if m["proj"] == "down_proj":
        return [(layer, e, "down", suffix, TensorPart(info, e, transpose)) for e in experts]
    return [(layer, e, proj, suffix, TensorPart(info, e, transpose, start, 2)) for e in experts for proj, start in (("gate", 0), ("up", 1))]


class GptOss(Architecture):
    model_type = "gpt_oss"
    attn_implementation = "eager"  # transformers' SDPA path has no attention sinks

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="swiglu",
            pattern=re.compile(r"(?!)"),  # no per-expert tensors: all come through split_fused
            template="",
            proj_names={"gate_up_proj": "gate", "down_proj": "down"},
            moe_layers=tuple(range(config.num_hidden_layers)),
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            split=split_fused,
        )

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        """Full-attention layers; sliding-window layers hold a fixed window (recurrent_bytes)."""
        return attention_layers_kv(config, dtype_bytes, sum(t == "full_attention" for t in config.layer_types))

    def recurrent_bytes(self, config, dtype_bytes: int) -> int:
        """The sliding-window layers' KV at their full window: a per-sequence cost that stops growing."""
        n = sum(t == "sliding_attention" for t in config.layer_types)
        return config.sliding_window * attention_layers_kv(config, dtype_bytes, n)

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        hf = build_hf_model(self, hf_config, tensors, strip_routed(lambda i: True), device, dtype)
        dt = hf.lm_head.weight.dtype
        limit = float(getattr(hf_config, "swiglu_limit", 7.0))

        def glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            g = g.clamp(max=limit)
            return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * ALPHA))

        def block(moe, i, k) -> MoEBlock:
            router = moe.router
            return MoEBlock(
                layer=i, index=k, kind="swiglu", top_k=hf_config.num_experts_per_tok, num_experts=hf_config.num_local_experts,
                router=lambda x: router(x)[1:], expert_input=lambda x: x, finish=lambda routed, x: routed,
                act=F.silu, act_name="gpt_oss_glu", combine_dtype=dt, glu=glu, act_args=(ALPHA, limit),
            )

        return DecoderResident(hf, lambda i: True, block, capture=PairCapture)


class PairCapture(MoECapture):
    """gpt-oss's MLP returns (output, router scores)."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        return super().forward(x), None
