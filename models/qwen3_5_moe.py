"""Qwen3.5-MoE, the language model: Qwen3-Next's layers (Gated DeltaNet or gated attention, then a
MoE with a sigmoid-gated shared expert) with a MoE in every layer, and multimodal RoPE, which for
text gives the three position axes the same positions.

Two configs name it, and transformers reads both into Qwen3_5MoeForCausalLM:
- `qwen3_5_moe_text` (what Qwen3_5MoeForCausalLM saves): model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight
  (gate/up [I, D], down [D, I]);
- `qwen3_5_moe`, the vision-language model with the LM's config as its text_config: the LM under
  model.language_model. (model.language_model.layers.L.mlp.experts.E...), beside the vision tower
  model.visual.* and the multi-token-prediction head mtp.*, which are not part of the LM and are skipped.
Routed experts are read per expert, as save_pretrained and the quantised (FP8, NVFP4, ...) releases
store them, or fused per layer as the BF16 releases store them: experts.gate_up_proj [E, 2I, D] (gate
the first I rows, up the last I) and experts.down_proj [E, D, I], cut per expert at repack by
`split_fused` (byte ranges: the store keeps the checkpoint's values).
"""

from __future__ import annotations

import re

from sluice.errors import CheckpointError
from sluice.models.base import ExpertSpec, LanguageModelOf, ResidentModel
from sluice.models.build import build_hf_model
from sluice.models.decoder import DecoderResident, strip_routed
from sluice.models.qwen3_next import Qwen3Next, gated_shared_block
from sluice.storage.safetensors_io import TensorInfo, TensorPart

_FUSED = re.compile(r"^model\.(?:language_model\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def split_fused(name: str, info: TensorInfo) -> list[tuple[int, int, str, str, TensorPart]] | None:
    """A fused expert tensor's per-expert parts: (layer, expert, proj, suffix, part); None for other tensors."""
    m = _FUSED.match(name)
    if m is None:
        return None
    layer, experts = int(m["layer"]), range(info.shape[0])
    if m["proj"] == "down_proj":
        return [(layer, e, "down", "weight", TensorPart(info, e)) for e in experts]
    if len(info.shape) != 3 or info.shape[1] % 2:
        raise CheckpointError(f"{info.file.name}: {name!r} of shape {list(info.shape)} is not [experts, 2 x intermediate, hidden]")
    half = info.shape[1] // 2
    return [(layer, e, "gate", "weight", TensorPart(info, e, stop=half)) for e in experts] + \
           [(layer, e, "up", "weight", TensorPart(info, e, start=half)) for e in experts]


class Qwen3_5Moe(LanguageModelOf, Qwen3Next):
    """The vision-language config; its LM's tensors live under model.language_model."""

    model_type = "qwen3_5_moe"
    prefix = "model.language_model."
    renames = ((r"^model\.language_model\.", "model."),)
    reverse_renames = ((r"^model\.", "model.language_model."),)

    def expert_spec(self, config) -> ExpertSpec:
        text = config.get_text_config()
        return ExpertSpec(
            kind="swiglu",
            pattern=re.compile(r"^model\.(?:language_model\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                               r"(?P<proj>\w+?)\.(?P<suffix>weight\w*|input_\w+)$"),
            template=f"{self.prefix}layers.{{layer}}.mlp.experts.{{expert}}.{{proj}}.{{suffix}}",
            proj_names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
            moe_layers=tuple(range(text.num_hidden_layers)),
            num_experts=text.num_experts,
            top_k=text.num_experts_per_tok,
            split=split_fused,
        )

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        hf = build_hf_model(self, hf_config, tensors, strip_routed(lambda i: True), device, dtype)
        text, dt = hf.config, hf.lm_head.weight.dtype
        return Qwen3_5MoeResident(hf, lambda i: True, lambda moe, i, k: gated_shared_block(moe, i, k, text, dt))


class Qwen3_5MoeText(Qwen3_5Moe):
    """The LM's own config; its tensors live under model."""

    model_type = "qwen3_5_moe_text"
    prefix = "model."
    reverse_renames = ()


class Qwen3_5MoeResident(DecoderResident):
    def position_embeddings(self, h, position_ids):
        """Multimodal RoPE over (temporal, height, width) positions [3,1,T], all three the text positions."""
        return self.hf.model.rotary_emb(h, position_ids[None].expand(3, -1, -1))
