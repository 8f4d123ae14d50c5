"""Tiny random-weight checkpoints built from transformers configs, saved as real HF checkpoints.

Used by the tests and as the default model until a trained one ships. At transformers' default
init the routed experts barely touch the residual stream and the router's scores are near-ties,
so a wrong expert path would still produce the same greedy tokens. We scale the routed experts
and the routers up (`expert_scale`, `router_scale`) so that the experts decide the output, and give
the NemotronH router a non-zero correction bias so that path is exercised.
"""

from __future__ import annotations

import json

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

ROUTER = re.compile(r"\.(mlp|mixer|block_sparse_moe)\.(gate|router)\.weight$")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IMAGE_SPECIALS = ("<image>", "<img>", "</img>")  # a vision-language tiny model's, after the characters
# a vision-language template: content may be a list of parts, an image part written as its placeholder
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB_SIZE = len(SPECIALS) + len(CHARS)  # 99


def tiny_config(arch: str, **overrides):
    """A small config of `arch` (nemotron_h | qwen3_moe | mixtral | deepseek_v3 | qwen3_next | gpt_oss, ...); keyword overrides win."""
    if arch == "nemotron_h":
        from transformers import NemotronHConfig

        base = dict(
            vocab_size=VOCAB_SIZE, hidden_size=64, hybrid_override_pattern="ME*EME", n_routed_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=None, n_group=1, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
            n_groups=2, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            bos_token_id=0, eos_token_id=2, pad_token_id=0,
        )
        return NemotronHConfig(**{**base, **overrides})
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
        from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

        text = tiny_config("nemotron_h", vocab_size=VOCAB_SIZE + len(IMAGE_SPECIALS)).to_dict()
        vision = dict(model_type="radio", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=16, image_size=64,
                      max_img_size=128, num_cls_tokens=1, num_registers=0, video_temporal_patch_size=2)
        return NemotronH_Omni_Reasoning_V3_Config(**{**dict(text_config=text, vision_config=vision, vision_hidden_size=32,
                                                            projector_hidden_size=48, image_token_id=VOCAB_SIZE), **overrides})
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
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(path)
    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # a vision-language config is saved whole, its LM beside the vision tower, as such checkpoints ship
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
        model = auto.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in list(model.named_parameters()) + list(model.named_buffers()):
                if ".experts." in name:
                    p.mul_(expert_scale)
                elif ROUTER.search(name):
                    p.mul_(router_scale)
                elif name.endswith("e_score_correction_bias"):
                    p.copy_(torch.randn_like(p) * 0.05)
                elif name.endswith("tid2eid"):  # hash routing: each token id's own top-k distinct experts
                    p.copy_(torch.rand(p.shape[0], config.n_routed_experts).argsort(-1)[:, : p.shape[1]])
    model.to(dtype).save_pretrained(path)
    if experts_format == "mxfp4":
        mxfp4_experts(path)
    elif experts_format is not None:
        raise ValueError(f"unknown experts_format {experts_format!r}")
    save_char_tokenizer(path, images=hasattr(config, "vision_config"))
    if hasattr(config, "vision_config"):  # the image processor's settings, scaled to the tiny tower (64 patches at most)
        (path / "preprocessor_config.json").write_text(json.dumps(
            {"patch_size": 16, "downsample_ratio": 0.5, "min_num_patches": 4, "max_num_patches": 64, "max_model_len": 64}))
    return path


def save_char_tokenizer(path: Path, images: bool = False) -> None:
    """A character tokenizer (newline + printable ASCII + chat specials; VOCAB_SIZE ids) with a
    ChatML-style template. Every id decodes to text that encodes back to the same ids, so a
    conversation's history re-tokenises exactly (what snapshot reuse needs). images: the image
    placeholders too (ids from VOCAB_SIZE on) and a template that writes image parts."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in CHARS + (list(IMAGE_SPECIALS) if images else []):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *(IMAGE_SPECIALS if images else ())],
    )
    fast.chat_template = VL_CHAT_TEMPLATE if images else CHAT_TEMPLATE
    fast.save_pretrained(path)


DEFAULT_MODEL = Path(__file__).resolve().parent / "default"


def default_model_path() -> Path:
    """The bundled default model: the small trained NemotronH in models/default (train/train.py).

    Where it is missing (a checkout without it), a deterministic tiny random NemotronH made on first use."""
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL
    return random_model_path()


def random_model_path() -> Path:
    """A deterministic tiny random NemotronH made on first use under SLUICE_HOME."""
    from sluice.log import get_logger
    from sluice.storage.home import sluice_home

    path = sluice_home() / "models" / "tiny-random-nemotron_h"
    if (path / "config.json").is_file():
        return path
    get_logger().info("making the default model: a tiny NemotronH with RANDOM weights (its text is noise)", path=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        make_tiny_checkpoint(tmp, "nemotron_h", seed=0, moe_latent_size=32)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
