"""The models Sluice bundles or makes itself, and the character tokenizer they share.

The default model is the small trained NemotronH in models/default (train/train.py); where a checkout lacks it, a
deterministic tiny NemotronH with RANDOM weights is made on first use under SLUICE_HOME (its text is noise).
`sluice bench images` makes its default the same way: a real-shaped image tower in front of that tiny LM. At
transformers' default init the routed experts barely touch the residual stream and the router's scores are
near-ties, so the random checkpoints scale the routed experts and the routers up (`expert_scale`, `router_scale`)
so that the experts decide the output, and give a NemotronH router a non-zero correction bias. (tests/tiny.py
builds the tests' tiny checkpoints of every architecture through `random_checkpoint`.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parent / "default"
ROUTER = re.compile(r"\.(mlp|mixer|block_sparse_moe)\.(gate|router)\.weight$")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IMAGE_SPECIALS = ("<image>", "<img>", "</img>")  # a vision-language model's, after the characters
# a vision-language template: content may be a list of parts, an image part written as its placeholder
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB_SIZE = len(SPECIALS) + len(CHARS)  # 99


def tiny_nemotron_config(**overrides):
    """The tiny NemotronH LM (hidden 64, pattern ME*EME, 16 experts top-4) of the character tokenizer; overrides win."""
    from transformers import NemotronHConfig

    base = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, hybrid_override_pattern="ME*EME", n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=None, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    return NemotronHConfig(**{**base, **overrides})


def tiny_omni_config(**overrides):
    """The tiny NemotronH LM beside a tiny RADIO vision tower (transformers 5.23+'s nemotron_h_omni); overrides win."""
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

    text = tiny_nemotron_config(vocab_size=VOCAB_SIZE + len(IMAGE_SPECIALS)).to_dict()
    vision = dict(model_type="radio", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=16, image_size=64,
                  max_img_size=128, num_cls_tokens=1, num_registers=0, video_temporal_patch_size=2)
    return NemotronH_Omni_Reasoning_V3_Config(**{**dict(text_config=text, vision_config=vision, vision_hidden_size=32,
                                                        projector_hidden_size=48, image_token_id=VOCAB_SIZE), **overrides})


def random_checkpoint(path: str | Path, config, seed: int = 0, expert_scale: float = 12.0, router_scale: float = 40.0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Build `config`'s model with random weights (seeded), scale its experts and routers, and save it at path as a
    real checkpoint (safetensors + config + the character tokenizer; a vision-language config whole, with its image
    processor's settings)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(path)
    images = hasattr(config, "vision_config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # a vision-language config is saved whole, its LM beside the vision tower, as such checkpoints ship
        auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
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
    save_char_tokenizer(path, images=images)
    if images:  # the image processor's settings, scaled to the tiny tower (64 patches at most)
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


def default_model_path() -> Path:
    """The bundled default model: the small trained NemotronH in models/default (train/train.py).

    Where it is missing (a checkout without it), a deterministic tiny random NemotronH made on first use."""
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL
    return random_model_path()


def random_model_path() -> Path:
    """A deterministic tiny random NemotronH (latent MoE) made on first use under SLUICE_HOME."""
    from sluice.log import get_logger
    from sluice.storage.home import sluice_home

    path = sluice_home() / "models" / "tiny-random-nemotron_h"
    if (path / "config.json").is_file():
        return path
    get_logger().info("making the default model: a tiny NemotronH with RANDOM weights (its text is noise)", path=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        random_checkpoint(tmp, tiny_nemotron_config(moe_latent_size=32), seed=0)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
