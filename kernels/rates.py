"""The machine's own transfer rates, measured now: pinned host-to-device copies and host memory reads (the
hybrid path balances by them; benchmarks put them beside every figure)."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
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
    Each count n keeps its last WINDOW calls' seconds, its figure their lower median: a call stalled by the OS or a
    neighbour (milliseconds where 0.2 is usual) moves nothing, and a count enters the line at its second call, so one
    stalled call of a count the balance then never gives again cannot hold the line (it did: a count of 2 timed once at
    2.8 ms left the CPU one block a layer, 2026-12-07); nor can a few (`_plausible`: a count's figure that one timed
    more often belies, as three calls of 2 blocks at 0.82 ms beside 2643 of one at 0.33 did, 2026-12-07). Figures given
    (`give`: the calibration's best of a few; `set`) stand for a count until it has two calls of its own. The two
    parts are the least-squares line through the figures, weighted by their calls (one count alone, or a line that
    slopes down: the line through 0), fitted when read."""

    WINDOW = 8

    def __init__(self) -> None:
        self._times: dict[int, deque[float]] = {}  # count -> its last calls' seconds
        self._given: dict[int, float] = {}  # count -> a figure given, not timed in the engine
        self._calls: dict[int, int] = {}  # count -> calls timed (what the benchmarks print beside the figures)
        self._line: tuple[float | None, float] | None = None  # (block_s, call_s); None: fitted at the next read

    def observe(self, n: int, seconds: float) -> None:
        self._times.setdefault(n, deque(maxlen=self.WINDOW)).append(seconds)
        self._calls[n] = self._calls.get(n, 0) + 1
        self._line = None

    def give(self, n: int, seconds: float) -> None:
        """A count's figure from a timing outside the engine's steps (the calibration's best of a few calls)."""
        self._given[n] = seconds
        self._line = None

    def set(self, block_s: float) -> None:
        """A figure given, not measured (a test's): per block only, earlier timings dropped."""
        self._times, self._calls, self._given, self._line = {}, {}, {1: block_s}, None

    @property
    def block_s(self) -> float | None:
        """A block's seconds; None until a call is timed or a figure given."""
        return self._fitted()[0]

    @property
    def call_s(self) -> float:
        return self._fitted()[1]

    def by_count(self) -> dict[int, tuple[float, int]]:
        """Each count of blocks a call was timed over -> (its figure in seconds, how many calls)."""
        return {n: (f, self._calls.get(n, 0)) for n, (f, _) in sorted(self._figures(single=True).items())}

    def seconds(self, n: int) -> float:
        """A call's predicted seconds over n blocks (0 for none)."""
        return self.call_s + n * self.block_s if n else 0.0

    def _figures(self, single: bool) -> dict[int, tuple[float, int]]:
        """count -> (figure, weight): a count's lower median once it has two calls (while no count timed more often
        belies it), else its given figure (while the counts timed do not belie it), else (with `single`, or where
        nothing else is known) its one call."""
        out = {n: (sorted(ts)[(len(ts) - 1) // 2], len(ts)) for n, ts in self._times.items() if len(ts) >= 2}
        out = {n: f for n, f in out.items()
               if _plausible(n, f[0], {m: g for m, g in out.items() if self._calls[m] > self._calls[n]})}
        timed = dict(out)
        out.update({n: (t, 1) for n, t in self._given.items() if n not in out and _plausible(n, t, timed)})
        if single or not out:
            out.update({n: (ts[0], 1) for n, ts in self._times.items() if n not in out})
        return out

    def _fitted(self) -> tuple[float | None, float]:
        if self._line is None:
            self._line = self._fit(self._figures(single=False))
        return self._line

    @staticmethod
    def _fit(figures: dict[int, tuple[float, int]]) -> tuple[float | None, float]:
        if not figures:
            return None, 0.0
        pts = [(n, t, w) for n, (t, w) in figures.items()]
        total = sum(w for _, _, w in pts)
        mean_n, mean_t = sum(n * w for n, _, w in pts) / total, sum(t * w for _, t, w in pts) / total
        var = sum(w * (n - mean_n) ** 2 for n, _, w in pts)
        slope = sum(w * (n - mean_n) * (t - mean_t) for n, t, w in pts) / var if var else 0.0
        call = mean_t - slope * mean_n
        if slope > 0 and call >= 0:
            return slope, call
        # one count, noise that slopes the line down, or a negative overhead: the line through 0
        return sum(w * n * t for n, t, w in pts) / sum(w * n * n for n, _, w in pts), 0.0


def _plausible(n: int, t: float, timed: dict[int, tuple[float, int]]) -> bool:
    """Whether a figure for a call of n blocks fits the other counts' figures `timed` (n not among them): no faster than
    a call of fewer blocks, no slower than one of more, nor than the calls of m blocks that would do its n (a
    calibration stalled as a whole gave 16.8 ms for one block and for four, where the engine's calls of two took 0.40:
    the line through them gave the CPU 1.4 blocks a token, H200 2026-12-07)."""
    return all(-(-n // m) * tm >= t and (t <= tm if n < m else t >= tm) for m, (tm, _) in timed.items())


class PairRate:
    """The CPU's seconds over a prompt layer's (block, row) pairs (h2d's `prompt_cpu`, as compute's `beside_cpu` times
    its calls): a call over b blocks with r rows in all takes `call_s + b * block_s + (r - b) * row_s`, a block's first
    row reading it from RAM, its next ones its weights from the threads' caches, decoded once for up to 4 rows
    (kernels/native/layers.c `relu2_rows`), so that a row of a block with several costs less than a block's first. The
    least-squares fit over the last WINDOW calls, fitted when read; where a part fits below 0 or the calls cannot tell it
    apart, it is dropped and the rest fitted again (the call's first, then the next rows priced as first ones).
    `parts`: None until a call is timed."""

    WINDOW = 64

    def __init__(self) -> None:
        self._calls: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)  # (blocks, rows, seconds)
        self._parts: tuple[float, float, float] | None = None

    def observe(self, blocks: int, rows: int, seconds: float) -> None:
        self._calls.append((blocks, rows, seconds))
        self._parts = None

    def parts(self) -> tuple[float, float, float] | None:
        """(block_s: a block's first row, call_s, row_s: each next row), `balance_prompt_cpu`'s order, or None before
        any call."""
        if self._parts is None and self._calls:
            self._parts = self._fit(np.array(self._calls, dtype=np.float64))
        return self._parts

    @staticmethod
    def _fit(calls: np.ndarray) -> tuple[float, float, float]:
        b, r, s = calls[:, 0], calls[:, 1], calls[:, 2]
        for cols in ((b, r - b, np.ones_like(b)), (b, r - b)):
            a = np.stack(cols, axis=1)
            coef, _, rank, _ = np.linalg.lstsq(a, s, rcond=None)
            if rank == a.shape[1] and (coef >= 0).all():
                return float(coef[0]), float(coef[2]) if len(coef) == 3 else 0.0, float(coef[1])
        t = float(s.sum() / r.sum())  # one price a row
        return t, 0.0, t
