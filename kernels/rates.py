"""The machine's own transfer rates, measured now: pinned host-to-device copies and host memory reads (the
hybrid path balances by them; benchmarks put them beside every figure)."""

from __future__ import annotations

import time

import torch


def h2d_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Pinned host-to-device copy rate in bytes/s (median of a few copies)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times)[len(times) // 2]


def ram_read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Host memory read rate (bytes/s) with torch's threads: the best of three sums over nbytes of fp32."""
    big = torch.ones(nbytes // 4, dtype=torch.float32)
    big.sum()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best
