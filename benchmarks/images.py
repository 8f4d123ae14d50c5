"""`sluice bench images`: seconds per image through a vision-language model's image encoder, resident, streamed
layer by layer, or on the CPU, against the PCIe floor of the streamed bytes."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sluice.kernels.rates import h2d_bandwidth


def radio_h_checkpoint() -> Path:
    """A vision-language checkpoint with a real-shaped image encoder (transformers' default RADIO-H tower:
    1280 wide, 32 layers; projector 4096) in front of a tiny NemotronH LM, random weights, made once under
    SLUICE_HOME: what `sluice bench images` times when no model is given."""
    from sluice.models.builtin import random_checkpoint, tiny_omni_config
    from sluice.storage.home import sluice_home

    path = sluice_home() / "models" / "radio-h-tiny-lm"
    if not (path / "config.json").is_file():
        from transformers import RadioConfig

        vision = {**RadioConfig().to_dict(), "video_temporal_patch_size": 2}
        config = tiny_omni_config(vision_config=vision, vision_hidden_size=1280, projector_hidden_size=4096)
        random_checkpoint(path, config, dtype=torch.bfloat16)
    return path


def bench_images(store_path, device: torch.device, patches=(1024, 4096), modes=("resident", "stream"), repeats: int = 3,
                 vram_free: int | None = None) -> list[dict]:
    """Seconds per image through the store's image encoder in each mode (resident, stream on the GPU; cpu),
    for square images of the given patch counts; with the streamed bytes' PCIe floor measured now."""
    from sluice.models.vision import ImageEncoder
    from sluice.storage.store import ExpertStore

    store = ExpertStore.open(store_path)
    rows = []
    for mode in modes:
        dev = torch.device("cpu") if mode == "cpu" else device
        dtype = torch.float32 if mode == "cpu" else torch.bfloat16
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        enc = ImageEncoder(store.path, store.manifest.encoder, dev, dtype, mode="auto" if mode == "cpu" else mode, vram_free=vram_free)
        floor = enc.stream.nbytes / h2d_bandwidth(dev) if enc.stream is not None else None
        for n in patches:
            side = max(2, round(n**0.5) // 2 * 2)
            grid = torch.tensor([[side, side]])
            pix = torch.randn(side * side, 3 * 16 * 16)
            enc.encode(pix, grid)  # warm (and compile nothing: eager)
            times = []
            for _ in range(repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t = time.perf_counter()
                enc.encode(pix, grid)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t)
            rows.append({"mode": enc.mode, "patches": side * side, "tokens": side * side // enc.merge**2, "s_per_image": min(times),
                         "encoder_mb": enc.nbytes / 1e6, "pcie_floor_s": floor,
                         "vram_peak_mb": (torch.cuda.max_memory_allocated(dev) - base) / 1e6 if dev.type == "cuda" else None})
        del enc
    return rows
