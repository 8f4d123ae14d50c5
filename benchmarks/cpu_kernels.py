"""`sluice bench cpu`: the CPU expert kernels (kernels/cpu.py) alone, one token through one expert at a time (and a
layer's top-k in one native call), against the memory read rate measured in the same run; `--calls`: the hybrid path's
calls by their count of blocks; `--pairs`: a prompt's (block, row) pairs, a block's rows side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import numpy as np
import torch

from sluice.benchmarks.kernels import FORMATS, SHAPES, Row, expert_layout
from sluice.kernels.cpu import CpuExperts
from sluice.kernels.rates import ram_read_bandwidth
from sluice.storage.store import pack_block


def bench_cpu(shapes=("nano", "qwen3-30b"), formats=FORMATS, threads: int | None = None, compiled: bool = True,
              experts: int = 32, int8: bool = False, min_bytes: int = 768 << 20) -> tuple[float, list[Row]]:
    """The CPU expert kernels (kernels/cpu.py), one token through one expert at a time (and, for experts that run whole in
    one native call, a layer's top-k of them per call: the "cpu layer" rows, microseconds per expert), cycling over
    `experts` distinct blocks, or more where they hold less than `min_bytes` (the GPU machine's CPU reports
    300 MiB of L3: the blocks must not fit), against the memory read rate measured
    now (a sum over 1 GiB with the same threads). With `int8`, FP4 experts also with int8 activations (a
    second row, where the machine has AVX-512 VNNI). Returns (read GB/s, rows)."""
    if threads:
        torch.set_num_threads(threads)
    read = ram_read_bandwidth() / 1e9
    rows = []
    for shape in shapes:
        kind, Dx, I, _ = SHAPES[shape]
        for fmt in formats:
            tensors, slots, fmts, block_bytes = expert_layout(kind, fmt, Dx, I, "cpu")
            block = pack_block(slots, tensors, torch.zeros(block_bytes, dtype=torch.uint8))
            n = max(experts, -(-min_bytes // block_bytes))
            bank = block.repeat(n)
            manifest = types.SimpleNamespace(formats=fmts, slots=slots)
            x = torch.randn(Dx)
            blocks = [bank[i * block_bytes : (i + 1) * block_bytes] for i in range(n)]
            nbytes = sum(s.nbytes for s in slots)
            for q8 in (False, True) if int8 and fmt in ("nvfp4", "mxfp4") else (False,):
                cpu = _experts(manifest, kind, compiled, q8)
                if q8 and not cpu.int8:
                    continue  # no AVX-512 VNNI here
                cpu.run(blocks[0], x)  # compile
                dt = float("inf")
                for _ in range(3):  # the best of three passes: shared machines are noisy
                    t = time.perf_counter()
                    for b in blocks:
                        cpu.run(b, x)
                    dt = min(dt, (time.perf_counter() - t) / n)
                gbps = nbytes / dt / 1e9
                rows.append(Row(f"cpu expert ({kind}{', int8' if q8 else ''})", shape, fmt, nbytes / 1e6, dt * 1e6, gbps, "RAM read",
                                100 * gbps / read))
                if cpu.plan is not None:  # a layer's A experts on one token in one call (the hybrid path's one-token steps)
                    A = SHAPES[shape][3]
                    dt = float("inf")
                    for _ in range(3):
                        t = time.perf_counter()
                        for i in range(0, n - A + 1, A):
                            cpu.run_many(blocks[i : i + A], x)
                        dt = min(dt, (time.perf_counter() - t) / (n // A * A))
                    gbps = nbytes / dt / 1e9
                    rows.append(Row(f"cpu layer ({kind}{', int8' if q8 else ''}) x{A}", shape, fmt, nbytes / 1e6, dt * 1e6, gbps,
                                    "RAM read", 100 * gbps / read))
    return read, rows


def _experts(manifest, kind: str, compiled: bool, int8: bool) -> CpuExperts:
    """The CPU expert kernels of a layout as the engine builds them (its activation named, so a native plan runs)."""
    return CpuExperts(manifest, kind, lambda v: torch.relu(v) ** 2 if kind == "relu2" else torch.nn.functional.silu(v),
                      compiled=compiled, act_name="relu2" if kind == "relu2" else "silu", int8=int8)


def _bank(what: str, shape: str, fmt: str, least: int, bank_bytes: int, int8: bool) -> tuple[list[torch.Tensor], CpuExperts]:
    """A bank of copies of one block of the layout (at least `least`, and `bank_bytes` of them: more than the CPU's
    caches; pinned where CUDA is, as the engine's RAM slots are), each block's view, and the layout's native kernels."""
    kind, Dx, I, _ = SHAPES[shape]
    tensors, slots, fmts, block_bytes = expert_layout(kind, fmt, Dx, I, "cpu")
    block = pack_block(slots, tensors, torch.zeros(block_bytes, dtype=torch.uint8))
    n = max(least, -(-bank_bytes // block_bytes))
    bank = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    bank.view(n, block_bytes)[:] = block
    cpu = _experts(types.SimpleNamespace(formats=fmts, slots=slots), kind, True, int8)
    if cpu.plan is None:
        raise SystemExit(f"bench cpu {what}: no native plan for {shape} {fmt} on this machine")
    if int8 and not cpu.int8:
        raise SystemExit(f"bench cpu {what} --int8: int8 activations need AVX-512 VNNI and FP4 weights, not here")
    return [bank[i * block_bytes : (i + 1) * block_bytes] for i in range(n)], cpu


def bench_calls(shape: str = "nano", fmt: str = "nvfp4", counts=(1, 2, 3, 4, 6), calls: int = 200, gap_us: float = 250.0,
                int8: bool = False, bank_bytes: int = 768 << 20) -> tuple[list[tuple[str, dict[int, float]]], dict]:
    """The hybrid path's calls (`CpuExperts.weighed_rows`: n of a layer's blocks on one token into bf16 rows), median
    microseconds a call by count: back to back over distinct blocks (from RAM); with the host spinning `gap_us`
    between calls, as it does waiting for a layer's ids (the team's threads may sleep meanwhile); the same blocks every
    call (from the CPU's caches: what is not the RAM read); and where CUDA is, back to back while pinned-to-device
    copies read RAM too, as PCIe's share of the blocks does in the engine (whether the two share the host's RAM
    bandwidth); and beside spinning processes, one more than the cores the team leaves free, so a thread of the team
    shares a core (as with a busy neighbour: a static split waits for that thread). The bank is pinned where CUDA is,
    as the engine's RAM slots are (`bank_bytes` of them: more than the CPU's caches). Returns ([(way, {count: us})], {"alone" | count: the copies' GB/s alone | beside that count's calls})."""
    _, Dx, _, K = SHAPES[shape]
    blocks, cpu = _bank("--calls", shape, fmt, 2 * max(counts), bank_bytes, int8)
    n = len(blocks)
    x, out = torch.randn(Dx), torch.empty(K, Dx, dtype=torch.bfloat16)
    copies = _Copies(torch.device("cuda")) if torch.cuda.is_available() else None
    h2d = {"alone": copies.alone} if copies else {}

    def way(gap: float, same: bool, beside: bool, busy: int) -> dict[int, float]:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        time.sleep(0.3 if busy else 0.0)  # their interpreters started and spinning
        try:
            return {c: timed(c, gap, same, beside) for c in counts}
        finally:
            for p in spinners:
                p.kill()
                p.wait()

    def timed(count: int, gap: float, same: bool, beside: bool = False) -> float:
        spent, at = [], 0
        done = copies.start(calls * count * 2e-4) if beside else None  # ~twice the calls' time, which run till the end
        more = (lambda: len(spent) < calls) if done is None else (lambda: not done.query())
        while more():
            if gap:
                t = time.perf_counter()
                while time.perf_counter() - t < gap:
                    pass
            some = blocks[:count] if same else [blocks[(at + j) % n] for j in range(count)]
            at += count
            w, rows = torch.rand(count), list(range(count))
            t = time.perf_counter()
            cpu.weighed_rows(some, x, w, torch.bfloat16, out, rows)
            spent.append(time.perf_counter() - t)
        if beside:
            h2d[count] = copies.rate()
        return sorted(spent)[len(spent) // 2] * 1e6

    timed(1, 0.0, True)  # the team's start
    busy = max(1, (os.cpu_count() or 1) - torch.get_num_threads() + 1)
    ways = [("back to back", 0.0, False, False, 0), (f"after {gap_us:.0f} us", gap_us * 1e-6, False, False, 0),
            ("in cache", 0.0, True, False, 0)]
    if copies:
        ways.append(("beside H2D copies", 0.0, False, True, 0))
    ways.append((f"beside {busy} busy", 0.0, False, False, busy))
    return [(name, way(*how)) for name, *how in ways], h2d


def bench_pairs(shape: str = "nano", fmt: str = "nvfp4", rows=(1, 2, 3, 4, 8), blocks: int = 16, calls: int = 20,
                int8: bool = False, bank_bytes: int = 768 << 20) -> tuple[dict[int, float], dict[int, float]]:
    """A prompt's CPU share (`CpuExperts.weighed_pairs`, h2d's `prompt_cpu`): calls over `blocks` distinct blocks with
    r rows each, a block's rows side by side, each call's blocks new (from RAM, as the engine's RAM slots are: pinned
    where CUDA is); median microseconds a block by r, back to back and (where CUDA is) beside pinned-to-device copies.
    A block's rows after its first cost what its weights' second pass from the threads' caches costs: the slope over r
    (compute's: int8 activations make it cheaper). Returns ({r: us a block}, {r: us a block beside the copies} or {})."""
    Dx = SHAPES[shape][1]
    bufs, cpu = _bank("--pairs", shape, fmt, 2 * blocks, bank_bytes, int8)
    n = len(bufs)
    copies = _Copies(torch.device("cuda")) if torch.cuda.is_available() else None

    def timed(r: int, beside: bool) -> float:
        x, w = torch.randn(blocks * r, Dx), torch.rand(blocks * r)
        out, at, spent = torch.empty(blocks * r, Dx, dtype=torch.bfloat16), 0, []
        done = copies.start(calls * blocks * r * 2e-4) if beside else None
        while len(spent) < calls or (done is not None and not done.query()):
            some = [bufs[(at + b) % n] for b in range(blocks) for _ in range(r)]
            at += blocks
            t = time.perf_counter()
            cpu.weighed_pairs(some, x, w, torch.bfloat16, out, list(range(blocks * r)))
            spent.append(time.perf_counter() - t)
        return sorted(spent)[len(spent) // 2] * 1e6 / blocks

    timed(1, False)  # the team's start
    return {r: timed(r, False) for r in rows}, ({r: timed(r, True) for r in rows} if copies else {})


def format_pairs(alone: dict[int, float], beside: dict[int, float], block_mb: float) -> str:
    """bench_pairs' table: us a block by its rows, then the line over them (a block's first row + each next)."""
    out = [f"{'us a block, median':22} " + " ".join(f"{r:>7}" for r in alone) + "   first row + each next   GB/s first"]
    for way, us in (("back to back", alone), ("beside H2D copies", beside)):
        if not us:
            continue
        slope, icept = np.polyfit(np.array(list(us), float), np.array(list(us.values())), 1)
        first = icept + slope
        out.append(f"{way:22} " + " ".join(f"{v:7.1f}" for v in us.values())
                   + f"   {first:9.1f} + {slope:9.1f}   {block_mb / first * 1e3 if first > 0 else 0:10.1f}")
    return "\n".join(out)


class _Copies:
    """Pinned-to-device copies of `nbytes` queued on a side stream: their rate alone, and while the host works."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20):
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream, self.nbytes, self.alone = torch.cuda.Stream(device), nbytes, 0.0
        self.start(0.0)  # the first copies: not a rate
        self.alone = self.rate()

    def start(self, seconds: float):
        """Queue about `seconds` of copies (at least eight) at the rate seen alone; returns the event after the last."""
        self.k = max(8, int(seconds * self.alone * 1e9 / self.nbytes))
        self.first, self.last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.first.record()
            for _ in range(self.k):
                self.dst.copy_(self.src, non_blocking=True)
            self.last.record()
        return self.last

    def rate(self) -> float:
        """GB/s of the copies queued last (waits for them)."""
        self.last.synchronize()
        return self.k * self.nbytes / (self.first.elapsed_time(self.last) * 1e-3) / 1e9


def format_calls(ways: list[tuple[str, dict[int, float]]], block_mb: float, h2d: dict | None = None) -> str:
    """bench_calls' table: a row a way, a column a count, then the least-squares line (us a call + us a block); then the
    copies' rate alone and beside each count's calls, where CUDA timed them."""
    counts = list(ways[0][1])
    out = [f"{'us a call, median':18} " + " ".join(f"{c:>7}" for c in counts) + "   call + block   GB/s in the slope"]
    for way, us in ways:
        xs, ys = np.array(counts, float), np.array([us[c] for c in counts])
        slope, icept = np.polyfit(xs, ys, 1)
        out.append(f"{way:18} " + " ".join(f"{us[c]:7.1f}" for c in counts)
                   + f"   {icept:5.1f} + {slope:5.1f}   {block_mb / slope * 1e3 if slope > 0 else 0:8.1f}")
    if h2d:
        out.append(f"{'H2D copies GB/s':18} " + " ".join(f"{h2d[c]:7.1f}" for c in counts if c in h2d)
                   + f"   (alone {h2d['alone']:.1f}): PCIe's reads beside the calls")
    return "\n".join(out)
