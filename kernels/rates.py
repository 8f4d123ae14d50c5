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


class CpuRate:
    """The CPU's expert kernels as measured in the engine: a call over n blocks takes `call_s + n * block_s` seconds.
    Each count n keeps a moving average of its calls' seconds (`observe`); the two parts are the least-squares line
    through them (one count alone, or a line that slopes down: the line through 0). A figure per block alone would charge
    a one-block call's overhead to its block, and a CPU given one block a layer would keep a slow first figure."""

    DECAY = 0.8  # a count's new call weighs 0.2 in its average

    def __init__(self) -> None:
        self._by_n: dict[int, float] = {}  # count -> moving average of its calls' seconds
        self._calls: dict[int, int] = {}  # count -> calls timed (what the benchmarks print beside the averages)
        self.block_s: float | None = None  # None until a call is timed
        self.call_s = 0.0

    def observe(self, n: int, seconds: float) -> None:
        old = self._by_n.get(n)
        self._by_n[n] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds
        self._calls[n] = self._calls.get(n, 0) + 1
        self._fit()

    def set(self, block_s: float) -> None:
        """A figure given, not measured (a test's, or a calibration's): per block only, earlier timings dropped."""
        self._by_n, self._calls = {1: block_s}, {}
        self._fit()

    def by_count(self) -> dict[int, tuple[float, int]]:
        """Each count of blocks a call was timed over -> (its moving average in seconds, how many calls)."""
        return {n: (self._by_n[n], self._calls.get(n, 0)) for n in sorted(self._by_n)}

    def seconds(self, n: int) -> float:
        """A call's predicted seconds over n blocks (0 for none)."""
        return self.call_s + n * self.block_s if n else 0.0

    def _fit(self) -> None:
        ns, ts = list(self._by_n), list(self._by_n.values())
        m = len(ns)
        mean_n, mean_t = sum(ns) / m, sum(ts) / m
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / var if var else 0.0
        call = mean_t - slope * mean_n
        if slope > 0 and call >= 0:
            self.block_s, self.call_s = slope, call
        else:  # one count, noise that slopes the line down, or a negative overhead: the line through 0
            self.block_s, self.call_s = sum(n * t for n, t in zip(ns, ts)) / sum(n * n for n in ns), 0.0
