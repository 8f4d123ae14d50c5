"""`sluice plan`: will a model fit, and how fast can it decode, from config.json and file headers alone.

No weight is loaded (safetensors shards may be truncated after their header; GGUF files are read
through the `gguf` package's tensor table). The figures:
- expert bytes per token = top-k x MoE layers x block bytes (the store's 4 KiB-rounded block);
- resident bytes (everything that is not a routed expert, as stored) -> VRAM;
- KV bytes per token (attention layers only) and recurrent state per sequence (Mamba, DeltaNet);
- bytes per format tier; whether VRAM and RAM suffice;
- a vision-language model's image encoder: its bytes, and whether it stays resident beside the rest
  or streams layer by layer (models/vision.py's rule: resident when it fits twice over in what is left);
- a decode rate from bytes over bandwidths: each token moves its expert blocks over PCIe, and
  the RAM misses also from disk. Without a routing trace the RAM hit rate is taken as the cached
  share of all blocks (uniform routing, a pessimistic guess); with one, it is simulated.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError
from sluice.models import ExpertSpec, get_architecture
from sluice.storage.checkpoint import Checkpoint
from sluice.storage.store import PAGE, round_up

GGUF_EXPERT = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<proj>up|down|gate)_exps\.weight$")


@dataclass
class Plan:
    architecture: str
    moe_layers: int
    num_experts: int
    top_k: int
    block_bytes: int
    expert_bytes_total: int
    resident_bytes: int
    kv_bytes_per_token: int
    recurrent_bytes: int
    tiers: dict[str, int] = field(default_factory=dict)  # format -> bytes
    vram: int = 0
    ram: int = 0
    context: int = 0
    vram_slots: int = 0
    ram_hit_rate: float = 0.0
    ram_blocks: int = 0
    pcie_gbps: float = 0.0
    disk_gbps: float = 0.0
    hit_source: str = "uniform"
    encoder_bytes: int = 0  # a vision-language model's image encoder (0: none)

    @property
    def encoder_resident(self) -> bool:
        """The image encoder stays on the GPU (else it streams from pinned RAM, two layers at a time)."""
        from sluice.models.vision import stays_resident

        return stays_resident(self.encoder_bytes, self.vram - self.vram_needed)

    @property
    def expert_bytes_per_token(self) -> int:
        return self.top_k * self.moe_layers * self.block_bytes

    @property
    def vram_needed(self) -> int:
        return self.resident_bytes + self.vram_slots * self.block_bytes + self.context * self.kv_bytes_per_token + self.recurrent_bytes

    @property
    def fits_vram(self) -> bool:
        return self.vram_needed <= self.vram

    @property
    def ms_per_token(self) -> float:
        """Expert I/O time per decode token: all blocks over PCIe, RAM misses also from disk (serial)."""
        b = self.expert_bytes_per_token
        pcie = b / (self.pcie_gbps * 1e9)
        disk = b * (1 - self.ram_hit_rate) / (self.disk_gbps * 1e9)
        return 1000 * (pcie + disk)

    @property
    def tokens_per_s(self) -> float:
        return 1000 / self.ms_per_token if self.ms_per_token else float("inf")


@dataclass(frozen=True)
class Sizes:
    """What a model's tensors weigh, by role: the input of a plan (read from headers, or estimated from config.json)."""

    hf: Any  # the transformers config
    arch: Any  # models/ Architecture
    spec: ExpertSpec
    block_bytes: int  # one routed expert's block, 4 KiB-rounded as the store lays it out
    resident_bytes: int  # everything that is not a routed expert or the image encoder
    tiers: dict[str, int]  # format -> bytes of the tensors stored in it (experts unrounded)
    encoder_bytes: int = 0  # a vision-language model's image encoder


def plan(path: str | Path, vram: int, ram: int, pcie_gbps: float = 28.0, disk_gbps: float = 7.0, context: int = 4096,
         trace=None, vram_slots: int | None = None) -> Plan:
    path = Path(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    sizes = _gguf(path, ggufs) if ggufs else _safetensors(path)
    return plan_of(sizes, vram, ram, pcie_gbps, disk_gbps, context, trace, vram_slots)


def plan_of(sizes: Sizes, vram: int, ram: int, pcie_gbps: float = 28.0, disk_gbps: float = 7.0, context: int = 4096,
            trace=None, vram_slots: int | None = None) -> Plan:
    """The plan of a model whose tensors weigh `sizes`: KV and state from its config, the RAM hit rate, the rates."""
    hf, arch, spec = sizes.hf, sizes.arch, sizes.spec
    total = sizes.block_bytes * spec.num_experts * len(spec.moe_layers)
    dtype_bytes = 2 if str(getattr(hf, "dtype", "bfloat16")) not in ("float32", "torch.float32") else 4
    p = Plan(hf.model_type, len(spec.moe_layers), spec.num_experts, spec.top_k, sizes.block_bytes, total, sizes.resident_bytes,
             arch.kv_bytes_per_token(hf, dtype_bytes), arch.recurrent_bytes(hf, dtype_bytes), dict(sizes.tiers),
             vram, ram, context, vram_slots if vram_slots is not None else 2 * spec.top_k, pcie_gbps=pcie_gbps, disk_gbps=disk_gbps,
             encoder_bytes=sizes.encoder_bytes)
    cache = max(0, ram - sizes.resident_bytes)  # host RAM left for the expert cache once the resident copy is loaded
    p.ram_blocks = min(total // sizes.block_bytes, cache // sizes.block_bytes)
    if trace is not None:
        from sluice.storage.simulate import simulate

        p.ram_hit_rate = simulate(trace, p.ram_blocks, decode_only=True, vram_as_recorded=False).hit_rate  # RAM alone
        p.hit_source = "simulated from the routing trace"
    else:
        p.ram_hit_rate = min(1.0, p.ram_blocks * sizes.block_bytes / total) if total else 1.0
    return p


def _gguf(path: Path, ggufs: list[Path]) -> Sizes:
    from transformers import AutoConfig

    from sluice.storage.checkpoint import read_config

    read_config(path)
    hf = AutoConfig.from_pretrained(path)
    arch = get_architecture(hf.model_type)
    spec = arch.expert_spec(hf)
    block_bytes, resident, tiers = _gguf_sizes(ggufs, spec)
    return Sizes(hf, arch, spec, block_bytes, resident, tiers)


def _safetensors(path: Path) -> Sizes:
    from sluice.storage.repack import classify

    ckpt = Checkpoint.open(path, headers_only=True)
    hf = ckpt.hf_config()
    arch = get_architecture(ckpt.model_type)
    spec = arch.expert_spec(hf)
    ex = classify(ckpt, spec, arch.ignored(hf), arch.encoder(hf))
    tiers: dict[str, int] = defaultdict(int)
    n_blocks = spec.num_experts * len(spec.moe_layers)
    first = ex.blocks[(spec.moe_layers[0], 0)]
    for proj, fmt in ex.formats.items():
        tiers[_tier(fmt.kind, first[f"{proj}.{fmt.weight}"].dtype)] += n_blocks * sum(i.nbytes for k, i in first.items() if k.startswith(proj + "."))
    for info in ex.resident.values():
        tiers[_tier_of_dtype(info.dtype)] += info.nbytes
    return Sizes(hf, arch, spec, ex.block_bytes, sum(i.nbytes for i in ex.resident.values()), dict(tiers),
                 sum(i.nbytes for i in ex.encoder.values()))


def _tier(kind: str, weight_dtype: str) -> str:
    return kind if kind != "dense" else _tier_of_dtype(weight_dtype)


def _tier_of_dtype(dtype: str) -> str:
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8", "U8": "u8"}.get(dtype, dtype.lower())


def _gguf_sizes(files: list[Path], spec) -> tuple[int, int, dict[str, int]]:
    """Block bytes, resident bytes and bytes per quantisation type of GGUF files."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
    except ImportError:
        raise CheckpointError("planning a GGUF checkpoint needs the `gguf` package (pip install gguf)") from None
    per_expert: dict[int, int] = defaultdict(int)
    resident = 0
    tiers: dict[str, int] = defaultdict(int)
    for f in files:
        for t in GGUFReader(f).tensors:
            n = int(t.n_bytes)
            tiers[GGMLQuantizationType(t.tensor_type).name.lower()] += n
            m = GGUF_EXPERT.match(t.name)
            if m is None:
                resident += n
                continue
            per_expert[int(m["layer"])] += n // spec.num_experts
    if not per_expert:
        raise CheckpointError(f"{files[0]}: no routed-expert tensors (blk.N.ffn_*_exps.weight) found")
    return round_up(max(per_expert.values()), PAGE), resident, dict(tiers)


def format_plan(p: Plan) -> str:
    gib = 2**30

    def g(n):
        return f"{n / gib:.2f} GiB"

    tiers = ", ".join(f"{k} {g(v)}" for k, v in sorted(p.tiers.items(), key=lambda kv: -kv[1]))
    lines = [
        f"architecture       {p.architecture}: {p.moe_layers} MoE layers x {p.num_experts} experts, top-{p.top_k}",
        f"expert block       {p.block_bytes:,} bytes; all experts {g(p.expert_bytes_total)}",
        f"expert bytes/token {p.expert_bytes_per_token / 1e6:.1f} MB ({p.top_k} x {p.moe_layers} blocks)",
        f"resident           {g(p.resident_bytes)} (VRAM)",
        f"KV cache           {p.kv_bytes_per_token:,} bytes/token (attention layers) -> {g(p.kv_bytes_per_token * p.context)} at {p.context} tokens",
        f"recurrent state    {p.recurrent_bytes / 2**20:.1f} MiB per sequence",
        f"bytes per format   {tiers}",
        f"VRAM               need {g(p.vram_needed)} (resident + {p.vram_slots} expert slots + KV + state) of {g(p.vram)}: "
        + ("fits" if p.fits_vram else "DOES NOT FIT"),
        *([f"image encoder      {g(p.encoder_bytes)}: " + ("resident on the GPU" if p.encoder_resident else
                                                             "streamed from pinned RAM layer by layer (does not fit twice in the VRAM left)")]
          if p.encoder_bytes else []),
        f"RAM cache          {p.ram_blocks:,} blocks ({g(p.ram_blocks * p.block_bytes)}) -> hit rate {p.ram_hit_rate:.1%} ({p.hit_source})",
        f"decode estimate    {p.ms_per_token:.1f} ms/token = {p.tokens_per_s:.1f} tok/s (PCIe {p.pcie_gbps} GB/s, disk {p.disk_gbps} GB/s; expert I/O only)",
    ]
    return "\n".join(lines)
