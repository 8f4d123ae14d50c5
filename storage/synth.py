"""`sluice synth`: random-weight HF checkpoints with the exact tensor shapes of real models.

    sluice synth --shape nemotron-3.5-super --moe-layers 4 --format nvfp4 OUT

The model is built on the meta device from a transformers config (no memory), its parameter
names and shapes become checkpoint tensors: resident ones in BF16 (router correction biases in
FP32), routed experts split per expert under the architecture's checkpoint names, in NVFP4, FP8
(128x128 blocks) or BF16. Values are random but valid (kernels/formats.py: random_weight), and
routing depends on the token as a trained model's does: every matrix is its own window of a random
pool (so every layer's router and every expert differ; windows, not draws, so tens of GB are
written at disk speed), and every vector (norm weights, biases, Mamba's A / D / dt, router
correction biases) is the model's own initial value (transformers' `_init_weights`: norms near 1)
plus small noise of its own; a correction bias that outweighed the router's logits would route
every token alike. `--moe-layers N` keeps the layers
up to the N-th MoE layer so a slice fits the disk. `--headers-only` writes shards that hold only
their headers: enough for `sluice plan`, and instant.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from sluice.errors import ConfigError
from sluice.kernels.formats import random_weight
from sluice.storage.safetensors_io import TORCH_TO_ST, encode_header, nbytes_of

NEMOTRON_COMMON = dict(mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, num_key_value_heads=2, head_dim=128,
                       vocab_size=131072, routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1)


def _nemotron_pattern(moe: int, mamba: int, attention: int) -> str:
    """M/E pairs with `attention` '*' layers spread evenly (counts as the real layer mix)."""
    pairs = ["ME"] * min(moe, mamba) + ["E"] * (moe - min(moe, mamba)) + ["M"] * (mamba - min(moe, mamba))
    step = max(1, len(pairs) // attention)
    out = []
    for i, p in enumerate(pairs):
        out.append(p)
        if attention and (i + 1) % step == 0 and out.count("*") < attention:
            out.append("*")
    return "".join(out) + "*" * (attention - "".join(out).count("*"))


SHAPES = {
    # Nemotron-3.5-Super: 88 layers (40 Mamba-2, 40 MoE, 8 attention), hidden 4096, latent 1024,
    # 512 experts top-22, expert up 2688x1024 + down 1024x2688 (NVFP4 block 3,096,576 bytes before scalars)
    "nemotron-3.5-super": ("nemotron_h", dict(NEMOTRON_COMMON, hybrid_override_pattern=_nemotron_pattern(40, 40, 8), hidden_size=4096,
                                              moe_latent_size=1024, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
                                              moe_shared_expert_intermediate_size=5376, mamba_num_heads=128, num_attention_heads=32)),
    "nemotron-3-nano-30b-a3b": ("nemotron_h", dict(NEMOTRON_COMMON, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                                                   hidden_size=2688, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                                                   moe_shared_expert_intermediate_size=3712, mamba_num_heads=64, num_attention_heads=32)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                        intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                        norm_topk_prob=True)),
    "qwen3-next-80b-a3b": ("qwen3_next", dict(hidden_size=2048, num_hidden_layers=48, num_experts=512, num_experts_per_tok=10,
                                              moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
                                              num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                              linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                                              full_attention_interval=4, vocab_size=151936)),
    "deepseek-v3": ("deepseek_v3", dict(num_nextn_predict_layers=0)),  # transformers' defaults are DeepSeek-V3's (61 layers, 3 dense)
}
FORMAT_KIND = {"nvfp4": "nvfp4", "fp8": "fp8_block", "bf16": "bf16"}
SHARD = 4 << 30
POOL = 64 << 20
EXPERT_SPREAD = 1 << 22  # an expert tensor's pool holds this many more values than it: distinct starts per expert
VECTOR_NOISE = 0.02  # a vector's noise: norms stay near 1, correction biases small beside the router's logits


def _config(shape: str, moe_layers: int | None):
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ConfigError(f"--shape: unknown {shape!r} (known: {', '.join(SHAPES)})")
    model_type, kw = SHAPES[shape]
    kw = dict(kw, dtype="bfloat16")
    cfg = AutoConfig.for_model(model_type, **kw)
    if moe_layers is not None and moe_layers < 1:
        raise ConfigError(f"--moe-layers: must be >= 1, got {moe_layers}")
    if moe_layers:
        from sluice.models import get_architecture

        moe = get_architecture(model_type).expert_spec(cfg).moe_layers
        if moe_layers > len(moe):
            raise ConfigError(f"--moe-layers: {shape} has {len(moe)} MoE layers, not {moe_layers}")
        keep = moe[moe_layers - 1] + 1
        if model_type == "nemotron_h":
            kw["hybrid_override_pattern"] = kw["hybrid_override_pattern"][:keep]
        else:
            kw["num_hidden_layers"] = keep
            if model_type == "qwen3_next":
                kw["layer_types"] = list(cfg.layer_types[:keep])
        cfg = AutoConfig.for_model(model_type, **kw)
    return model_type, cfg


def tensor_plan(shape: str, fmt: str, moe_layers: int | None = None):
    """(config, [(name, safetensors dtype, shape, maker)]) of a synthetic checkpoint; makers give tensors on demand."""
    from transformers import AutoModelForCausalLM

    from sluice.models import get_architecture

    if fmt not in FORMAT_KIND:
        raise ConfigError(f"--format: {fmt!r} is not nvfp4, fp8 or bf16")
    model_type, cfg = _config(shape, moe_layers)
    arch = get_architecture(model_type)
    spec = arch.expert_spec(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    vectors = _initial_vectors(model)
    plan, expert_shapes = [], {}
    pool = _Pool()
    for key, t in model.state_dict().items():
        leaf = key.rsplit(".", 1)[-1]
        if ".experts." in key and leaf in ("up_proj", "down_proj", "gate_up_proj"):  # fused routed experts
            E, out, inp = t.shape
            if leaf == "gate_up_proj":
                expert_shapes["gate"] = expert_shapes["up"] = (out // 2, inp)
            else:
                expert_shapes[leaf.split("_")[0]] = (out, inp)
            continue
        dtype = "F32" if "e_score_correction_bias" in key else "BF16"
        make = pool.vector(vectors[key], key, dtype) if key in vectors else pool.window(tuple(t.shape), key)
        plan.append((arch.checkpoint_name(key), dtype, tuple(t.shape), make))
    kind = FORMAT_KIND[fmt]
    pools, shapes = {}, {}
    for i, p in enumerate(spec.projs):  # per projection: a pool of valid values per suffix, and one expert's shapes
        made = random_weight(_pool_shape(expert_shapes[p]), kind, generator=torch.Generator().manual_seed(i))
        pools[p] = {sfx: t.reshape(-1) for sfx, t in made.items()}
        shapes[p] = {sfx: tuple(t.shape) for sfx, t in random_weight(expert_shapes[p], kind, device="meta").items()}
    for layer in spec.moe_layers:
        for e in range(spec.num_experts):
            for proj in spec.projs:
                for suffix, flat in pools[proj].items():
                    name = spec.name(layer, e, proj, suffix)
                    shape = shapes[proj][suffix]
                    plan.append((name, TORCH_TO_ST[flat.dtype], shape, _expert_window(flat, shape, name)))
    return cfg, plan


def _pool_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """A pool of valid expert values with room for EXPERT_SPREAD windows' distinct starts past one tensor's size."""
    out, inp = shape
    return out + 128 * -(-EXPERT_SPREAD // (128 * inp)), inp  # whole 128-row blocks: FP8's block scales stay whole


def _expert_window(flat: torch.Tensor, shape: tuple[int, ...], name: str):
    """One expert's tensor: a window of its pool starting at an offset of its own (scalars: the pool's first value)."""
    n = 1
    for d in shape:
        n *= d
    room = flat.numel() - n
    start = _seed(name) % room if room > 0 else 0
    return lambda: flat[start : start + n].reshape(shape)


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _initial_vectors(model) -> dict[str, torch.Tensor]:
    """The model's own initial value of each vector (1-D parameter or buffer), by state-dict name: transformers'
    `_init_weights` run on each module with its vectors made real on the CPU (its matrices stay on the meta device)."""
    out = {}
    for mod_name, module in model.named_modules():
        names = [n for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
                 if t is not None and t.dim() <= 1 and n not in getattr(module, "_non_persistent_buffers_set", ())]
        if not names:
            continue
        for n in names:
            t = getattr(module, n)
            real = torch.zeros(t.shape, dtype=torch.float32)
            if n in module._parameters:
                module._parameters[n] = torch.nn.Parameter(real, requires_grad=False)
            else:
                module._buffers[n] = real
        with torch.no_grad():
            model._init_weights(module)
        for n in names:
            out[f"{mod_name}.{n}" if mod_name else n] = getattr(module, n).detach().clone()
    return out


class _Pool:
    """Valid random resident values at memory speed: matrices as windows of one BF16 pool (normal, std 0.02), each
    from an offset of its own; vectors as their initial value plus noise of their own (std VECTOR_NOISE)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.bf16 = (torch.randn(POOL // 2, generator=g) * 0.02).to(torch.bfloat16)

    def window(self, shape, name: str):
        n = 1
        for d in shape:
            n *= d
        src = self.bf16

        def make():
            if not n:
                return torch.empty(shape, dtype=src.dtype)
            start = _seed(name) % src.numel()
            reps = -(-(start + n) // src.numel())
            return (src.repeat(reps) if reps > 1 else src)[start : start + n].reshape(shape)

        return make

    def vector(self, initial: torch.Tensor, name: str, dtype: str):
        def make():
            g = torch.Generator().manual_seed(_seed(name))
            v = initial.float() + torch.randn(initial.shape, generator=g) * VECTOR_NOISE
            return v.to(torch.float32 if dtype == "F32" else torch.bfloat16)

        return make


def synth(shape: str, fmt: str, out: str | Path, moe_layers: int | None = None, headers_only: bool = False, progress: bool = True) -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty")
    cfg, plan = tensor_plan(shape, fmt, moe_layers)
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    for item in plan:
        n = nbytes_of(item[1], item[2])
        if current and size + n > SHARD:
            shards.append(current)
            current, size = [], 0
        current.append((*item, n))
        size += n
    shards.append(current)
    weight_map = {}
    total = sum(n for s in shards for *_, n in s)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {shape}", disable=not progress or headers_only)
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out / name, shard, headers_only, bar)
        weight_map.update({t[0]: name for t in shard})
    bar.close()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg.sluice_synthetic = True  # benchmarks name runs on these weights' own routing as no speed claim
    cfg.save_pretrained(out)
    if fmt in ("nvfp4", "fp8"):
        algo = {"nvfp4": "NVFP4", "fp8": "FP8"}[fmt]
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "sluice synth"},
                                                              "quantization": {"quant_algo": algo, "group_size": 16}}))
    return out


def _write_shard(path: Path, tensors, headers_only: bool, bar) -> None:
    with open(path, "wb") as f:
        f.write(encode_header((name, dtype, shape, n) for name, dtype, shape, _, n in tensors))
        if headers_only:
            return
        for _, _, _, make, n in tensors:
            t = make().contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes())
            bar.update(n)
        f.flush()
        os.fsync(f.fileno())
