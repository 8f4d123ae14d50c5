"""Where a step's time goes (`sluice bench model --profile`, `bench batch --profile`): the host's Python functions
(cProfile, by own time) and, on CUDA, the GPU's busy time per token by op (torch.profiler), so host overhead shows as
the gap between the two.
"""

from __future__ import annotations

import json
import tempfile
import time

import torch


# Triton kernels that read expert blocks (a checkpoint's quantized resident weights also go through _matvec_kernel)
EXPERT_KERNELS = ("_matvec_kernel", "_down_relaid_kernel", "_x_pairs_kernel", "_grouped_gemm_kernel", "_weigh_parts_kernel")


def device_table(device: list, tokens: int, rows: int = 40) -> str:
    """The GPU's ops by own time: per token, their count, time each and time in all (names cut to 70 characters)."""
    device = sorted(device, key=lambda e: -e.self_device_time_total)
    lines = [f"  {'ms/token':>8} {'ops/token':>9} {'us each':>8}  GPU op"]
    for e in device[:rows]:
        lines.append(f"  {e.self_device_time_total / 1e3 / tokens:8.3f} {e.count / tokens:9.1f} "
                     f"{e.self_device_time_total / max(e.count, 1):8.2f}  {e.key[:70]}")
    rest = device[rows:]
    if rest:
        lines.append(f"  {sum(e.self_device_time_total for e in rest) / 1e3 / tokens:8.3f} "
                     f"{sum(e.count for e in rest) / tokens:9.1f} {'':>8}  ({len(rest)} other ops)")
    return "\n".join(lines)


def profile_decode(engine, tokens: int = 8, top: int = 25, seed: int = 0, split: dict | None = None) -> str:
    """Where a decode step's time goes (`profile_steps` over `tokens` one-token steps of one sequence).
    `split`, if given, receives the GPU time per token in ms: busy, Sluice's expert kernels, the rest (resident)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.model.config.vocab_size, (32,), generator=g).tolist()
    engine.generate(prompt, tokens)  # warm caches and kernels
    seq = engine.new_sequence()
    token = [int(engine.extend(seq, prompt)[-1].argmax())]

    def step():
        token[0] = int(engine.extend(seq, token)[-1].argmax())
    return profile_steps(engine, step, 1, tokens, top, split)


def profile_prefill(engine, tokens: int, steps: int = 2, top: int = 25, seed: int = 1, empty: bool = False) -> str:
    """Where a `tokens`-token prompt's time goes (`profile_steps` over `steps` prompts, each on a fresh sequence, on the
    VRAM tier the prompts before left, or on an empty one: `empty`), per prompt token."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size

    def step():
        if empty:
            engine.empty_vram()
        seq = engine.new_sequence()
        engine.extend(seq, torch.randint(3, vocab, (tokens,), generator=g).tolist(), last=True)
        engine.release(seq)
    step()  # warm: kernels compiled, the tier filled as a prompt fills it
    return profile_steps(engine, step, tokens, steps, top, copies=True)


def profile_steps(engine, step, rows: int, steps: int, top: int = 25, split: dict | None = None, copies: bool = False) -> str:
    """Where `steps` calls of step() (each generating `rows` tokens) go: host Python functions (cProfile, by own time)
    and, on CUDA, the GPU's busy time per token (torch.profiler: kernels and copies), so host overhead shows as the
    gap; with `copies`, the host-to-device copies' timeline (`copy_timeline`: a prompt's blocks cross PCIe as copies).
    `split`, if given, receives the GPU time per token in ms: busy, Sluice's expert kernels, the rest."""
    import cProfile
    import io
    import pstats

    tokens = rows * steps
    lines = []
    if engine.device.type == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - t) / tokens
        events = prof.key_averages()
        # the device's own events (kernels, copies); a host op's "self" device time repeats its kernels' time
        device = [e for e in events if e.device_type != DeviceType.CPU]
        busy = sum(e.self_device_time_total for e in device) / 1e3 / tokens  # us -> ms per token
        launches = sum(e.count for e in device) / tokens
        lines.append(f"profiled wall {1000 * wall:.2f} ms/token; GPU busy {busy:.2f} ms/token ({busy / (1000 * wall):.0%}; kernels and "
                     f"copies, summed over streams); {launches:.0f} GPU ops/token")
        experts = sum(e.self_device_time_total for e in device if e.key.startswith(EXPERT_KERNELS)) / 1e3 / tokens
        if split is not None:
            split.update(busy_ms=busy, experts_ms=experts, resident_ms=busy - experts)
        lines.append(f"  Sluice's expert kernels {experts:.2f} ms/token (zero-copy reads from RAM included), everything else "
                     f"{busy - experts:.2f} ms/token: the resident part's own GPU time")
        lines.append(device_table(device, tokens))
        if copies:  # the copies' timeline: the trace's own timestamps
            with tempfile.TemporaryDirectory() as d:
                prof.export_chrome_trace(f"{d}/trace.json")
                with open(f"{d}/trace.json") as f:
                    timeline = copy_timeline(json.load(f).get("traceEvents", []))
            if timeline:
                lines.append(timeline)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    lines.append(f"cProfile wall {1000 * (time.perf_counter() - t) / tokens:.2f} ms/token (with profiling overhead)")
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)  # which callers the own time sits under
    lines.append(buf.getvalue())
    return "\n".join(lines)


def copy_timeline(events: list[dict], gap_us: float = 50.0, top: int = 5) -> str:
    """From a profile's trace events (Chrome's format): the host-to-device copies' busy time (their union) from the
    first copy to the last, the time PCIe sat idle between them in gaps of `gap_us` or more, and the longest gaps with
    the GPU's kernel time inside each: a gap the kernels fill is PCIe waiting for the GPU (a router's ids); one they do
    not, waiting for the host. "" without copies."""
    def spans(keep) -> list[tuple[float, float]]:
        out: list[list[float]] = []
        for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and keep(e)):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    copies = spans(lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""))
    if not copies:
        return ""
    kernels = spans(lambda e: e.get("cat") == "kernel")
    inside = lambda a, b: sum(max(0.0, min(b, y) - max(a, x)) for x, y in kernels)  # noqa: E731
    gaps = [(b, a2) for (_, b), (a2, _) in zip(copies, copies[1:]) if a2 - b >= gap_us]
    span, busy = copies[-1][1] - copies[0][0], sum(b - a for a, b in copies)
    idle = sum(b - a for a, b in gaps)
    lines = [f"host-to-device copies: busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms from the first to the last "
             f"({busy / span:.0%}); idle in {len(gaps)} gaps of {gap_us:.0f} us or more: {idle / 1e3:.2f} ms, "
             f"the GPU's kernels running {sum(inside(a, b) for a, b in gaps) / 1e3:.2f} ms of it"]
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        lines.append(f"  gap at {(a - copies[0][0]) / 1e3:8.2f} ms: {(b - a) / 1e3:6.3f} ms, kernels {inside(a, b) / 1e3:6.3f} ms of it")
    return "\n".join(lines)
