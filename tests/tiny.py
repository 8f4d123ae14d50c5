"""Tiny random-weight checkpoints of every architecture, from transformers configs, saved as real HF checkpoints: the
tests' fixtures (imported as `tiny`). Built, scaled and saved by the product's `random_checkpoint` (models/builtin.py:
the experts and routers scaled up so that the experts decide the output), with the character tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sluice.models.builtin import VOCAB_SIZE, random_checkpoint, tiny_nemotron_config, tiny_omni_config


def tiny_config(arch: str, **overrides):
    """A small config of `arch` (nemotron_h | qwen3_moe | mixtral | deepseek_v3 | qwen3_next | gpt_oss, ...); keyword overrides win."""
    if arch == "nemotron_h":
        return tiny_nemotron_config(**overrides)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        base = dict(
            vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            intermediate_size=96, mlp_only_layers=[2], decoder_sparse_step=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, norm_topk_prob=True, max_position_embeddings=1024, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        )
        return Qwen3MoeConfig(**{**base, **overrides})
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if arch == "mixtral":
        from transformers import MixtralConfig

        base = dict(common, intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2)
        return MixtralConfig(**{**base, **overrides})
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        base = dict(common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                    n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, head_dim=8, num_nextn_predict_layers=0)
        return DeepseekV3Config(**{**base, **overrides})
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        base = dict(common, num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96, decoder_sparse_step=1,
                    mlp_only_layers=[])
        return Qwen3NextConfig(**{**base, **overrides})
    if arch in ("qwen3_5_moe", "qwen3_5_moe_text"):
        from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

        text = dict(common, num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48)
        if arch == "qwen3_5_moe_text":
            return Qwen3_5MoeTextConfig(**{**text, **overrides})
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, num_position_embeddings=64)
        return Qwen3_5MoeConfig(**{**dict(text_config=text, vision_config=vision), **overrides})
    if arch == "nemotron_h_omni":  # transformers 5.23+: the NemotronH LM beside a tiny RADIO vision tower
        return tiny_omni_config(**overrides)
    if arch == "deepseek_v4":
        from transformers import DeepseekV4Config

        # sliding and compression windows shorter than the test prompt, the indexer's top-k below the compressed
        # entries, a hash-routed layer; an expert clamp low enough to bind
        base = dict(common, num_hidden_layers=4, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2,
                    o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                    layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                                 "compressed_sparse_attention"],
                    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=4,
                    sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=2, num_nextn_predict_layers=0,
                    swiglu_limit=1.0)
        return DeepseekV4Config(**{**base, **overrides})
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        # sliding window shorter than the test prompt; YaRN as the real model, its factor consistent with the lengths
        base = dict(common, intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=8,
                    num_local_experts=16, num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 32, "truncate": False})
        return GptOssConfig(**{**base, **overrides})
    raise ValueError(f"no tiny config for {arch!r}")


def make_tiny_checkpoint(path: str | Path, arch: str = "nemotron_h", seed: int = 0, expert_scale: float = 12.0,
                         router_scale: float = 40.0, dtype: torch.dtype = torch.float32, experts_format: str | None = None,
                         **overrides) -> Path:
    """Build, scale and save a tiny random checkpoint (safetensors + config + tokenizer) at path.

    experts_format="mxfp4" (gpt_oss) then stores the fused experts as gpt-oss ships them (mxfp4_experts)."""
    if experts_format not in (None, "mxfp4"):
        raise ValueError(f"unknown experts_format {experts_format!r}")
    path = random_checkpoint(path, tiny_config(arch, **overrides), seed, expert_scale, router_scale, dtype)
    if experts_format == "mxfp4":
        mxfp4_experts(path)
    return path


def mxfp4_experts(path: Path) -> None:
    """Rewrite a saved gpt-oss checkpoint's fused experts (gate_up_proj [E, D, 2I], down_proj [E, I, D])
    as MXFP4 `*_blocks` / `*_scales` [E, out, in/32, 16] / [E, out, in/32], with the quantization_config
    transformers reads them by."""
    import json

    from safetensors.torch import load_file, save_file

    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(f)
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensors.pop(name).transpose(1, 2).float())
        save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                      "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (blocks uint8 [..., out, in/32, 16], E8M0 scales uint8 [..., out, in/32]).

    Each 32-input group gets the power of two that brings its largest magnitude to at most 6 (the
    largest E2M1 value); values round to the nearest E2M1 code."""
    from sluice.kernels.formats import E2M1, MXFP4_GROUP

    *lead, out, inp = w.shape
    g = w.reshape(*lead, out, inp // MXFP4_GROUP, MXFP4_GROUP)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
    q = g / torch.exp2(exp)[..., None]
    levels = torch.tensor(E2M1[:8])
    code = (q.abs()[..., None] - levels).abs().argmin(-1) | ((q < 0).long() << 3)
    code = code.reshape(*lead, out, inp // MXFP4_GROUP, MXFP4_GROUP // 2, 2)
    return (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)
