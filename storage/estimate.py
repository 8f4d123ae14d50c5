"""`sluice plan` before the download: what the model weighs in each format, from config.json alone.

The model is built on the meta device from its config (no memory is allocated): its parameters give
every tensor's shape, the fused routed experts of its first MoE layer give an expert's projections.
Each format then gets a plan (storage/plan.py plan_of) as if its checkpoint's headers had been read:
- safetensors formats (bf16, fp8 with 128 x 128 blocks, nvfp4, mxfp4): routed experts in the format,
  with the scales kernels/formats.py gives them, laid out in blocks as `sluice repack` would; the rest
  in the config's dtype, as checkpoints published in these formats mostly keep it;
- GGUF types: every matrix at the type's bits per weight (the `gguf` package's GGML_QUANT_SIZES),
  vectors in F32. One type for all matrices: llama.cpp's mixes (Q4_K_M, ...) lie between two rows.
  Sluice runs safetensors checkpoints; these rows size the files a GGUF runtime would load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.errors import CheckpointError
from sluice.models import get_architecture
from sluice.storage.plan import Plan, Sizes, plan_of
from sluice.storage.repack import SUFFIX_ORDER
from sluice.storage.safetensors_io import TORCH_TO_ST
from sluice.storage.store import PAGE, plan_layout, round_up

SAFETENSORS_FORMATS = {"bf16": "bf16", "fp8": "fp8_block", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}  # tier -> formats.py kind
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_XXS", "Q2_K", "IQ2_XS", "IQ1_M")
FUSED = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\..*\.experts\.(?P<proj>gate_up_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class Tier:
    """One format's row of the estimate."""

    name: str  # bf16 | fp8 | nvfp4 | mxfp4 | gguf Q4_K | ...
    bits: float  # bits per routed-expert weight, scales included (the block's bytes, unrounded)
    plan: Plan | None  # None: the format cannot hold this model's experts
    why: str = ""  # why not, when plan is None

    @property
    def weights(self) -> int:
        """All weight bytes as the format stores them (the download)."""
        return sum(self.plan.tiers.values()) + self.plan.encoder_bytes

    @property
    def total(self) -> int:
        """Weights, the KV cache at the plan's context and one sequence's recurrent state."""
        p = self.plan
        return self.weights + p.kv_bytes_per_token * p.context + p.recurrent_bytes

    @property
    def fits(self) -> str:
        """all in VRAM | streamed (Sluice's resident part, slots, KV and state fit) | no."""
        if self.total <= self.plan.vram:
            return "all in VRAM"
        return "streamed" if self.plan.fits_vram else "no"


def has_weights(path: Path) -> bool:
    """Whether a folder holds weight files a plan reads sizes from (safetensors or GGUF)."""
    return any(path.glob("*.safetensors")) or any(path.glob("*.gguf")) or (path / "model.safetensors.index.json").exists()


def estimate(path: str | Path, vram: int, ram: int, pcie_gbps: float = 28.0, disk_gbps: float = 7.0, context: int = 4096,
             trace=None) -> list[Tier]:
    """One row per format for the model config.json describes; nothing but config.json is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sluice.storage.checkpoint import read_config

    path = Path(path)
    read_config(path)
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a bad config
        raise CheckpointError(f"{path / 'config.json'}: transformers cannot read it: {e}") from None
    arch = get_architecture(hf.model_type)
    spec = arch.expert_spec(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=getattr(hf, "dtype", None) or torch.bfloat16)
    experts, resident = _split(model.state_dict(keep_vars=True), spec)
    args = (vram, ram, pcie_gbps, disk_gbps, context, trace)
    rows = [_safetensors_tier(name, kind, hf, arch, spec, experts, resident, args) for name, kind in SAFETENSORS_FORMATS.items()]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return rows  # format_estimate says how to get the GGUF rows
    for name in GGUF_TYPES:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        rows.append(_gguf_tier(name, block, size, hf, arch, spec, experts, resident, args))
    return rows


def _split(state: dict[str, torch.Tensor], spec) -> tuple[dict[str, tuple[int, int]], list[torch.Tensor]]:
    """(one routed expert's projections: block proj -> (out, in), the resident tensors)."""
    experts, resident, seen = {}, [], set()
    for key, t in state.items():
        if id(t) in seen:  # a tied weight (the head shares the embeddings): stored once
            continue
        seen.add(id(t))
        m = FUSED.search(key)
        if m is None:
            resident.append(t)
            continue
        if int(m["layer"]) == spec.moe_layers[0]:
            _, out, inp = t.shape
            if m["proj"] == "gate_up_proj":
                experts["gate"] = experts["up"] = (out // 2, inp)
            else:
                experts[m["proj"].split("_")[0]] = (out, inp)
    missing = [p for p in spec.projs if p not in experts]
    if missing:
        raise CheckpointError(f"{spec.template or 'this model'}: transformers' model has no fused routed-expert tensors for "
                              f"{', '.join(missing)} in layer {spec.moe_layers[0]}; a plan needs the checkpoint's headers")
    return experts, resident


def _safetensors_tier(name, kind, hf, arch, spec, experts, resident, args) -> Tier:
    from sluice.kernels.formats import random_weight

    entries = []
    for proj in spec.projs:
        try:
            tensors = random_weight(experts[proj], kind, device="meta")  # shapes and dtypes only
        except ValueError as e:  # the format's groups do not divide this projection
            return Tier(name, 0.0, None, f"{proj}: {e}")
        for suffix in sorted(tensors, key=SUFFIX_ORDER.index):
            t = tensors[suffix]
            entries.append((proj, suffix, tuple(t.shape), TORCH_TO_ST[t.dtype], t.numel() * t.element_size(),
                            proj in spec.relaid and t.dim() == 2))
    _, block = plan_layout(entries)
    expert = sum(e[4] for e in entries)
    rest = sum(t.numel() * t.element_size() for t in resident)
    tiers = {name: expert * spec.num_experts * len(spec.moe_layers)}
    tiers[_dtype_name(resident)] = tiers.get(_dtype_name(resident), 0) + rest  # bf16 experts beside a bf16 rest
    return Tier(name, 8 * expert / _weights_per_expert(experts, spec), plan_of(Sizes(hf, arch, spec, block, rest, tiers), *args))


def _gguf_tier(name, block, size, hf, arch, spec, experts, resident, args) -> Tier:
    def quantised(n: int) -> int:
        return -(-n // block) * size

    expert = sum(quantised(out * inp) for out, inp in (experts[p] for p in spec.projs))
    matrices = sum(quantised(t.numel()) for t in resident if t.dim() >= 2)
    vectors = sum(4 * t.numel() for t in resident if t.dim() < 2)
    tiers = {name.lower(): expert * spec.num_experts * len(spec.moe_layers) + matrices, "f32": vectors}
    sizes = Sizes(hf, arch, spec, round_up(expert, PAGE), matrices + vectors, tiers)
    return Tier(f"gguf {name}", 8 * size / block, plan_of(sizes, *args))


def _weights_per_expert(experts, spec) -> int:
    return sum(out * inp for out, inp in (experts[p] for p in spec.projs))


def _dtype_name(resident: list[torch.Tensor]) -> str:
    """The dtype most resident bytes are in, as plan names formats (bf16, fp32, ...)."""
    by: dict[torch.dtype, int] = {}
    for t in resident:
        by[t.dtype] = by.get(t.dtype, 0) + t.numel() * t.element_size()
    dtype = max(by, key=by.get) if by else torch.bfloat16
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype).removeprefix("torch."))


def format_estimate(rows: list[Tier]) -> str:
    """The table `sluice plan` prints for a folder with config.json alone."""
    p = next(r.plan for r in rows if r.plan is not None)
    gib, mib = 2**30, 2**20

    def g(n: float) -> str:
        return f"{n / gib:.2f} GiB"

    lines = [
        f"{p.architecture} from config.json alone (no weight files): {p.moe_layers} MoE layers x {p.num_experts} experts, top-{p.top_k}",
        f"KV cache {p.kv_bytes_per_token:,} bytes/token (attention layers) -> {g(p.kv_bytes_per_token * p.context)} at "
        f"{p.context:,} tokens; recurrent state {p.recurrent_bytes / mib:.1f} MiB per sequence",
        f"VRAM {g(p.vram)}, RAM {g(p.ram)}; decode estimate: each token's expert blocks streamed over PCIe ({p.pcie_gbps} GB/s), "
        f"the RAM misses also read from disk ({p.disk_gbps} GB/s); RAM hit rate {p.hit_source}",
        "",
        f"{'tier':<13}{'bits':>6}{'weights':>12}{'KV':>11}{'state':>11}{'total':>12}  {'fits':<12}{'experts/token':>14}"
        f"{'RAM hit':>9}{'decode':>13}",
    ]
    for r in rows:
        if r.plan is None:
            lines.append(f"{r.name:<13}  n/a: {r.why}")
            continue
        q = r.plan
        lines.append(f"{r.name:<13}{r.bits:>6.2f}{g(r.weights):>12}{g(q.kv_bytes_per_token * q.context):>11}"
                     f"{q.recurrent_bytes / mib:>7.1f} MiB{g(r.total):>12}  {r.fits:<12}{q.expert_bytes_per_token / 1e6:>11.1f} MB"
                     f"{q.ram_hit_rate:>9.0%}{q.tokens_per_s:>7.1f} tok/s")
    lines.append("")
    lines.append("fits: all in VRAM = weights + KV + state within --vram; streamed = Sluice's resident part, "
                 f"{p.vram_slots} expert slots, KV and state within it, the experts from RAM and disk")
    lines.append("safetensors rows: routed experts in the format, the rest in the config's dtype; GGUF rows: every matrix "
                 "at the type, for comparison (Sluice runs safetensors)")
    if not any(r.name.startswith("gguf") for r in rows):
        lines.append("(install the `gguf` package for the GGUF rows: pip install gguf)")
    return "\n".join(lines)
