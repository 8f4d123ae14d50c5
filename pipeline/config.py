"""Engine settings: a frozen dataclass validated on construction; errors name the setting and value."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from sluice.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(value: str | int | float | None, what: str) -> int | None:
    """'8GiB', '512MiB', '1.5GB', 4096 -> bytes. None stays None."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m[2].lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot read {value!r} as a size (e.g. 8GiB, 512MiB, 2GB)")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def default_ram_cache(available: int) -> int:
    """A streaming schedule's RAM cache when --ram-cache is not given: a quarter of the RAM free now (the rest is the
    page cache's, the prompts' and the system's)."""
    return available // 4


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str | None = None  # resident dtype; None = the checkpoint's
    ram_cache: int | None = None  # bytes of host RAM for expert blocks; None = a quarter of free RAM, at most all blocks
    vram_slots: int | None = None  # expert slots on the GPU; None = 4 x top-k, or what vram_budget leaves
    vram_budget: int | None = None  # bytes of GPU memory the engine may use (emulates a smaller card)
    vram_reserve: int | None = None  # bytes of the VRAM budget kept free of expert slots; None: from the need (budget.py)
    max_batch: int = 1  # sequences one step may hold (serve --max-batch): the budget keeps room for their states
    schedule: str = "auto"  # schedule name (schedules/NAME.yaml) or path; auto: direct where every block fits in RAM,
    # direct-hybrid where they do not all fit in VRAM, else direct-stream (pipeline/schedule.py `auto_schedule`)
    readers: int | None = None  # reader threads; None = the schedule's (fetch's or direct's `readers`)
    verify_checksums: bool = True
    direct_io: bool = True
    trace: str | None = None  # path for Chrome trace JSON (+ .jsonl stage lines)
    record_routing: str | None = None  # path for a routing trace (storage/trace.py), replayed by `sluice simulate`
    routing: str = "natural"  # natural | uniform | skewed[:...] | trace:FILE (storage/routing.py): benchmarks' routing
    resident_graphs: bool = True  # CUDA: replay one-token steps of in-place-state layers (Mamba) as graphs
    whole_step: bool | None = None  # CUDA: replay a one-token step whole as one graph where nothing in it needs the
    # host (pipeline/whole.py: a `via: table` schedule holding every block, and static_kv); None: on models checked on a
    # GPU (ResidentModel.whole_checked), True: on others too, False: never
    fused_ops: bool | None = None  # RMSNorms and routers in Triton launches where the model has them (ResidentModel.fuse:
    # kernels/norm.py, router.py); None: on CUDA
    fused_linears: bool | None = None  # one-row float linears (16- or 32-bit) of the resident part in one Triton launch each
    # (kernels/gemv.py, in place of cuBLAS's split-K pair); None: on CUDA
    embed_on_host: bool | None = None  # the input embedding's table in pinned RAM, each token's row read over PCIe
    # (kernels/embed.py): its VRAM goes to expert slots; a head tied to it keeps it on the device; None: on with CUDA
    # and a VRAM budget (faster in all four runs that timed it at 8 GiB: BENCHMARKS.md, 12-07)
    fused_mamba: bool | None = None  # Mamba-2 one-token steps in two Triton launches and prompts' scan in one (kernels/mamba.py); None: on CUDA
    # (a CPU then takes kernels/mamba.py's torch step and an fp32 conv: models/nemotron_h.py); False: transformers' step
    image_encoder: str = "auto"  # vision-language models on CUDA: auto | resident | stream (models/vision.py)
    prefill_chunk: int | None = None  # longest prompt piece one step runs (each of its experts read once); None: 2048
    static_kv: int | None = None  # attention over a static cache of up to this many tokens (transformers' StaticCache,
    # its slots allocated as the sequence needs them: models/static_cache.py) instead of a growing one: fixed tensors,
    # what a one-token step replayed as a CUDA graph needs; a sequence may not grow past it. 0: the growing cache; None:
    # the model's context on CUDA for models whose whole step is checked (pipeline/whole.py `default_static_kv`), else 0
    mixer_chunk: int | None = None  # longest run of a piece a Mamba-2 mixer prefills at once (its scratch grows with it);
    # None: the whole piece with the fused scan (no scratch), else 512, or with a VRAM budget the largest power of two
    # <= 512 whose scratch fits what the expert slots leave (budget.py `plan_budget`)

    def __post_init__(self):
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device: {self.device!r} is not auto, cpu, cuda or cuda:N")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device!r} asked for, but CUDA is not available here")
        if self.image_encoder not in ("auto", "resident", "stream"):
            raise ConfigError(f"image_encoder: {self.image_encoder!r} is not auto, resident or stream")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: {self.dtype!r} is not float32, bfloat16 or float16")
        if self.vram_slots is not None and self.vram_budget is not None:
            raise ConfigError("vram_slots and vram_budget: give one (the budget sizes the slot bank itself)")
        from sluice.storage.routing import parse_routing

        parse_routing(self.routing)  # a bad setting is named before anything is opened
        if self.vram_reserve is not None and self.vram_budget is None:
            raise ConfigError("vram_reserve: it sizes a VRAM budget's reserve; give vram_budget (--vram-budget) too")
        for name in ("ram_cache", "vram_slots", "vram_budget", "vram_reserve", "readers", "prefill_chunk", "mixer_chunk", "static_kv", "max_batch"):
            v, least = getattr(self, name), 0 if name == "static_kv" else 1
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ConfigError(f"{name}: must be a {'positive integer' if least else 'count of tokens (0: off)'}, got {v!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.dtype) if self.dtype else None

    def embeds_on_host(self, device: torch.device) -> bool:
        """Whether the input embedding's table goes to pinned RAM: as asked, else with CUDA and a VRAM budget (where
        its VRAM becomes expert slots)."""
        return self.embed_on_host if self.embed_on_host is not None else device.type == "cuda" and self.vram_budget is not None
