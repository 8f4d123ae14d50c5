"""`sluice bench model`: decode and prefill speed of a whole model through the engine, with the I/O behind it.

Prefill: a fresh sequence per prompt length (random token ids), timed end to end, twice: on the VRAM tier as the
engine opened it (blocks spread over the layers, `vram_fill`; empty without it), then with other ids on the tier the
first left (prompts fill its free slots: the direct schedule). Decode: a
32-token prompt, then `decode_tokens` greedy steps, each timed (the sampled id reaching the host
is the step's sync). Untimed runs of the same shapes come first, so that Triton's compiles and the CUDA
graph captures a process does once are not timed; with `warm` they also leave the RAM cache filled,
without it (`--cold`) the expert caches are emptied after them: each timed prompt, and decode's 32-token prompt,
starts from the disk. Reported per
decode token: blocks and bytes per tier, hit rate, prefetch recall, fetch stall; and, on CUDA,
the roofline: bytes that crossed PCIe over the pinned host-to-device bandwidth measured in the
same run (the time a perfect pipeline would need for the expert I/O alone), and each prompt's (its PCIe floor).
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from sluice.kernels.rates import h2d_bandwidth
from sluice.pipeline.runtime import TIERS


def disk_bandwidth(engine, blocks: int = 128) -> float:
    """The drive's expert-block read rate in bytes/s, read as the engine's reader pool reads (its threads, O_DIRECT
    where the store allows it): `blocks` blocks spread over the store, after an untimed read per file, into memory
    faulted in beforehand (as the RAM cache's slots are), and without checksums (the engine's reads verify them: host
    work, not the drive's). The disk term of a roofline."""
    from sluice.storage.reader import BlockReader, HostArena

    store, pool = engine.store, engine.rt.reader
    n = min(blocks, store.total_blocks)
    arena = HostArena(n, store.block_bytes, pin=False)
    arena.data.fill_(1)  # a first touch of fresh memory (a page fault per page) is not the drive's time
    layers, E = list(store.moe_layers), store.manifest.num_experts
    picks = [(layers[(i * 7) % len(layers)], (i * 37) % E) for i in range(n)]
    reader = BlockReader(store, threads=pool.threads, direct=pool.direct, verify=False, pieces=len(pool.pieces))
    try:
        for layer in layers:  # starts the threads, opens each layer's file
            reader.submit(layer, 0, arena.slot(0)).result()
        t = time.perf_counter()
        futures = [reader.submit(l, e, arena.slot(i)) for i, (l, e) in enumerate(picks)]
        for f in futures:
            f.result()
        return n * store.block_bytes / (time.perf_counter() - t)
    finally:
        reader.close()


def _whole_counts(engine) -> tuple[int, int] | None:
    """(replays, captures) of the engine's whole one-token steps so far; None without them."""
    whole = engine.whole
    return (whole.replays, whole.captures) if whole is not None else None


def _step_kind(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """How a timed step ran: captured (a whole step this process had not captured: the untimed runs should have), a
    replay, layer by layer (a state's first sight, or whole steps stopped); "" without whole steps."""
    if before is None or after is None:
        return ""
    return "captured" if after[1] > before[1] else "replayed" if after[0] > before[0] else "layer by layer"


def _how(d: dict, k: int) -> str:
    """How timed step k ran, for the slowest steps' line: " (replayed, 37 blocks on the CPU)"."""
    kind = (d.get("step_kinds") or [""] * (k + 1))[k]
    cpu = (d.get("step_cpu_blocks") or [0] * (k + 1))[k] if d.get("cpu_blocks_per_token") else None
    parts = [kind] if kind else []
    if cpu is not None:
        parts.append(f"{cpu} blocks on the CPU")
    return f" ({', '.join(parts)})" if parts else ""


def bench_model(engine, prompt_lengths=(32, 512), decode_tokens: int = 32, warm: bool = True, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    out: dict = {"routing": routing_name(engine), "synthetic_weights": synthetic_weights(engine), "prefill": {}, "decode": {}}
    sync = engine.rt.streams.synchronize

    def prefill(n: int) -> dict:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        before, flushes = engine.rt.stats.snapshot(), allocator_flushes(engine.device)
        seq = engine.new_sequence()
        t = time.perf_counter()
        engine.extend(seq, ids, last=True)  # as generation prefills: the head on the last row
        sync()
        dt = time.perf_counter() - t
        engine.release(seq)  # as a finished request's: its state goes to the next sequence (not left to the GC)
        io = engine.rt.stats.since(before)
        return {"s": dt, "tok_s": n / dt, "blocks": io["blocks"], "vram_fills": io["vram_fills"], "cpu_blocks": io["cpu_blocks"],
                "cpu_s": io["cpu_prompt_s"],  # the CPU's calls, beside the copies: the prompt's other floor
                # copied over PCIe: the blocks read from RAM or disk but the CPU's, and the next layers' copied ahead
                "pcie_blocks": io["blocks"]["ram"] + io["blocks"]["disk"] - io["cpu_blocks"] + io["vram_prefetches"],
                "allocator_flushes": allocator_flushes(engine.device) - flushes}

    for n in prompt_lengths:
        prefill(n)  # a first prompt of this length compiles its kernels (grouped GEMM tiles, Mamba runs): untimed
        engine.empty_vram() if warm else engine.drop_caches()
        out["prefill"][n] = prefill(n)  # on the VRAM tier as opened
        out["prefill"][n]["next"] = prefill(n)  # other ids, on the tier as that prompt left it
    prompt = torch.randint(3, vocab, (32,), generator=g).tolist()
    engine.generate(prompt, decode_tokens if warm else min(decode_tokens, 4))
    if not warm:
        engine.drop_caches()
    seq = engine.new_sequence()
    logits = engine.extend(seq, prompt)
    before, flushes = engine.rt.stats.snapshot(), allocator_flushes(engine.device)
    times, kinds, cpu_steps = [], [], []  # kinds: how each step ran (`_step_kind`); cpu_steps: its blocks on the CPU
    token = int(logits[-1].argmax())
    with gc_pauses() as pauses:
        for _ in range(decode_tokens):
            seen, cpu = _whole_counts(engine), engine.rt.stats.cpu_blocks
            t = time.perf_counter()
            token = int(engine.extend(seq, [token])[-1].argmax())
            times.append(time.perf_counter() - t)
            kinds.append(_step_kind(seen, _whole_counts(engine)))
            cpu_steps.append(engine.rt.stats.cpu_blocks - cpu)
    io = engine.rt.stats.since(before)
    engine.release(seq)
    n, block = decode_tokens, engine.store.block_bytes
    per_tier = {t: io["blocks"][t] / n for t in TIERS}
    rate = engine.rt.cpu_rate
    total = sum(io["blocks"].values())
    first = times[0]  # a sequence's first step: its state is a released one (generate's), so no capture unless none was spare
    steps = [round(1000 * t, 3) for t in times]  # in order: a step that slows down for good shows where it began
    times = sorted(times)
    d = out["decode"] = {
        "tokens": n, "step_ms": steps, "step_kinds": kinds, "step_cpu_blocks": cpu_steps,
        "ms_per_token_median": 1000 * times[n // 2], "ms_per_token_mean": 1000 * sum(times) / n,
        "ms_first_token": 1000 * first, "ms_per_token_mean_after_first": 1000 * (sum(times) - first) / max(n - 1, 1),
        "tok_s": n / sum(times), "blocks_per_token": per_tier, "bytes_per_token": {t: v * block for t, v in per_tier.items()},
        "hit_rate": 1 - io["blocks"]["disk"] / total if total else None,
        "prefetch_recall": io["predicted_right"] / io["routed_predicted"] if io["routed_predicted"] else None,
        # of the guesses made two or more MoE layers ahead (a depth > 1)
        "prefetch_recall_further": io["further_right"] / io["further_routed"] if io["further_routed"] else None,
        "stall_ms_per_token": 1000 * io["stall_s"] / n,
        "ids_wait_ms_per_token": 1000 * io["ids_wait_s"] / n,
        # time with a block read on the drive, and its share of the decode time: how idle the drive was in a cold run
        "disk_busy_ms_per_token": 1000 * io["disk_busy_s"] / n, "disk_busy_share": io["disk_busy_s"] / sum(times),
        # a read's mean time queued and on the drive, by kind (demand: a step waited for it; guess): whether guesses
        # land before their layer needs them
        **{f"{kind}_read_{what}_ms": 1000 * io[f"{kind}_{what}_s"] / io[f"{kind}_reads_timed"] if io[f"{kind}_reads_timed"] else None
           for kind in ("demand", "guess") for what in ("queued", "drive")},
        "cpu_blocks_per_token": io["cpu_blocks"] / n,
        "vram_prefetches_per_token": io["vram_prefetches"] / n,  # copied on a guess (right or wrong): PCIe bytes too
        "vram_prefetch_hits_per_token": io["vram_prefetch_hits"] / n,
        "vram_fills_per_token": io["vram_fills"] / n,  # the direct schedule's hot-set refreshes: PCIe bytes too
        "cpu_ms_per_block": 1000 * rate.block_s if rate.block_s else None,
        "cpu_ms_per_call": 1000 * rate.call_s,  # the CPU kernels' overhead a call (a layer's blocks), beside a block's
        "cpu_calls": {n: [round(1000 * t, 4), c] for n, (t, c) in rate.by_count().items()},  # blocks -> [ms, calls timed]
        "live_group_fraction": io["live_groups"] / io["total_groups"] if io["total_groups"] else None,
        "allocator_flushes": allocator_flushes(engine.device) - flushes,
        "refreshes": io["refreshes"], "refresh_host_ms": 1000 * io["refresh_s"] / max(io["refreshes"], 1),
        "refresh_wait_ms": 1000 * io["refresh_wait_s"] / max(io["refreshes"], 1),
        "gc_pauses_ms": [round(ms, 2) for ms in pauses],
    }
    d["vram_slots"] = engine.rt.vram.capacity if engine.rt.vram is not None else 0
    d["ram_slots"] = engine.rt.ram.capacity
    if engine.device.type == "cuda":
        d["vram_peak_bytes"] = torch.cuda.max_memory_allocated(engine.device)  # before the PCIe rate's test buffer
        d["vram_held_peak_bytes"] = torch.cuda.max_memory_reserved(engine.device)  # what the budget's cap counts
        bw = h2d_bandwidth(engine.device)
        # blocks that crossed PCIe: demand copies (not the hybrid path's CPU blocks) and guesses copied ahead
        moved = (per_tier["ram"] + per_tier["disk"] - io["cpu_blocks"] / n + (io["vram_prefetches"] + io["vram_fills"]) / n) * block
        d["h2d_gbps"] = bw / 1e9
        d["roofline_ms_per_token"] = 1000 * moved / bw
        if rate.block_s:  # the hybrid's floor: the RAM blocks split so that PCIe and the CPU (at its
            # measured rate) finish together; the tier's fills and copies ahead cross PCIe alone
            both, fills = bw + block / rate.block_s, (io["vram_prefetches"] + io["vram_fills"]) / n * block
            d["hybrid_roofline_ms_per_token"] = 1000 * max((per_tier["ram"] * block + fills) / both, fills / bw)
        # the guesses copied ahead that no step read: PCIe bytes, but ones a perfect guess would not move
        d["unread_guesses_ms_per_token"] = 1000 * max(0, io["vram_prefetches"] - io["vram_prefetch_hits"]) / n * block / bw
        for p in (q for first in out["prefill"].values() for q in (first, first["next"])):  # each prompt's PCIe floor
            p["pcie_floor_s"] = p["pcie_blocks"] * block / bw
    reads = (io["blocks"]["disk"] + io["prefetch_reads"]) / n  # every block read from disk, for demand or on a guess
    d["disk_reads_per_token"] = reads
    if reads:
        disk = disk_bandwidth(engine)
        d["disk_gbps"] = disk / 1e9
        d["disk_roofline_ms_per_token"] = 1000 * reads * block / disk + d.get("roofline_ms_per_token", 0.0)
        # the guesses read that no step then routed to (or not yet): disk time a perfect guess would not spend
        d["unread_guess_reads_ms_per_token"] = 1000 * max(0, io["prefetch_reads"] - io["prefetch_hits"]) / n * block / disk
    return out


def routing_name(engine) -> str:
    """The routing a run's figures were measured under (storage/routing.py), as every bench table names it."""
    return str(engine.routing.setting) if engine.routing is not None else "natural"


@contextlib.contextmanager
def gc_pauses():
    """The Python garbage collector's pauses (ms each) while the block runs: a collection over every object the
    process holds can take tens of ms, paid by the step that happens to trigger it."""
    pauses, start = [], [0.0]

    def timed(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses.append(1000 * (time.perf_counter() - start[0]))
    gc.callbacks.append(timed)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timed)


def allocator_flushes(device: torch.device) -> int:
    """How often the CUDA allocator, at the budget's cap, synchronized and gave its cached blocks back to allocate
    again (each costs a device sync and cudaMalloc calls): a reserve that is too small shows here; 0 off CUDA."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def synthetic_weights(engine) -> bool:
    return bool(getattr(engine.model.config, "sluice_synthetic", False))


def routing_line(r: dict) -> str:
    """The routing a result was measured under; on random weights' own routing, said to be no speed claim."""
    line = f"routing: {r['routing']}"
    if r["routing"] == "natural" and r.get("synthetic_weights"):
        line += (" (random weights' own routing: not a speed claim; --routing uniform | skewed | trace:FILE for figures "
                 "that stand for a real model)")
    return line


def _prompt_row(n: int, p: dict) -> str:
    """A prompt length's row: the first prompt's seconds and rate, the next's, their blocks by tier (and the CPU's), and
    on CUDA each one's PCIe floor (its blocks copied, over the host-to-device rate measured in the run) and time over it."""
    nxt = p["next"]
    tiers = lambda q: f"{q['blocks']['vram']} / {q['blocks']['ram'] + q['blocks']['disk']}"  # noqa: E731
    row = (f"{n:8d} {p['s']:10.3f} {p['tok_s']:10.1f}   next: {nxt['s']:.3f} s, {nxt['tok_s']:.1f} tok/s, "
           f"blocks VRAM / RAM {tiers(nxt)} (first: {tiers(p)})")
    if p.get("cpu_blocks") or nxt.get("cpu_blocks"):
        row += (f"; of the RAM blocks on the CPU {nxt['cpu_blocks']} in {nxt['cpu_s']:.3f} s (first: {p['cpu_blocks']} in "
                f"{p['cpu_s']:.3f} s)")
    if "pcie_floor_s" in p:
        floor = lambda q: f"{q['pcie_floor_s']:.3f} s ({q['s'] / max(q['pcie_floor_s'], 1e-9):.2f} x)"  # noqa: E731
        row += f"; PCIe floor {floor(p)}, next {floor(nxt)}"
    return row + _flushes(p.get("allocator_flushes", 0) + nxt.get("allocator_flushes", 0))


def format_bench(r: dict, block_bytes: int) -> str:
    lines = [routing_line(r),f"{'prompt':>8} {'prefill s':>10} {'tok/s':>10}   (a prompt on the VRAM tier as opened; the next prompt, on the tier it left)"]
    lines += [_prompt_row(n, p) for n, p in r["prefill"].items()]
    d = r["decode"]
    lines.append(f"decode: {d['tok_s']:.2f} tok/s (mean {d['ms_per_token_mean']:.2f} ms/token), median {d['ms_per_token_median']:.2f} "
                 f"ms/token over {d['tokens']} tokens; first token {d['ms_first_token']:.1f} ms, mean of the rest "
                 f"{d['ms_per_token_mean_after_first']:.2f} ms")
    lines.append("  blocks/token " + ", ".join(f"{t} {v:.2f} ({v * block_bytes / 1e6:.1f} MB)" for t, v in d["blocks_per_token"].items()))
    hit = f"{d['hit_rate']:.1%}" if d["hit_rate"] is not None else "n/a"
    rec = f"{d['prefetch_recall']:.1%}" if d["prefetch_recall"] is not None else "n/a"
    if d.get("prefetch_recall_further") is not None:
        rec += f" (guesses 2+ MoE layers ahead: {d['prefetch_recall_further']:.1%})"
    lines.append(f"  hit rate {hit}, prefetch recall {rec}, fetch stall {d['stall_ms_per_token']:.2f} ms/token, "
                 f"waiting for routed ids {d['ids_wait_ms_per_token']:.2f} ms/token")
    if d["vram_prefetches_per_token"]:
        lines.append(f"  VRAM prefetch: {d['vram_prefetches_per_token']:.2f} blocks/token copied ahead on a guess, "
                     f"{d['vram_prefetch_hits_per_token']:.2f} of them then routed (VRAM hits)")
    if d["vram_fills_per_token"]:
        lines.append(f"  VRAM hot set: {d['vram_fills_per_token']:.2f} blocks/token copied in by its refreshes")
    if d["cpu_blocks_per_token"]:
        each = (f", {d['cpu_ms_per_block']:.2f} ms each and {d.get('cpu_ms_per_call', 0):.2f} ms a call (measured; "
                f"{block_bytes / d['cpu_ms_per_block'] / 1e6:.1f} GB/s of expert bytes)") if d.get("cpu_ms_per_block") else ""
        lines.append(f"  hybrid: {d['cpu_blocks_per_token']:.2f} blocks/token computed on the CPU from RAM (not copied){each}")
        if d.get("cpu_calls"):  # the averages the rate's line is fitted through (kernels/rates.py)
            lines.append("  the CPU's calls: " + ", ".join(f"{n} blocks {t:.3f} ms ({c} timed)" for n, (t, c) in d["cpu_calls"].items()))
    elif d.get("cpu_ms_per_block"):  # a schedule with the CPU's share that gave it none: the rate that decided so
        lines.append(f"  hybrid: the CPU computed no blocks (its rate {d['cpu_ms_per_block']:.2f} ms a block, "
                     f"{block_bytes / d['cpu_ms_per_block'] / 1e6:.1f} GB/s of expert bytes)")
    slow = sorted(range(len(d["step_ms"])), key=lambda k: -d["step_ms"][k])[:3]
    gcs = d.get("gc_pauses_ms", [])
    lines.append("  slowest steps: " + ", ".join(f"#{k} {d['step_ms'][k]:.1f} ms{_how(d, k)}" for k in slow)
                 + (f"; VRAM tier refreshes {d['refreshes']}, {d['refresh_host_ms']:.2f} ms each on the host (of which "
                    f"{d['refresh_wait_ms']:.2f} waiting for the GPU's counts)"
                    if d.get("refreshes") else "")
                 + f"; Python GC pauses {len(gcs)}" + (f", {sum(gcs):.1f} ms in all, the longest {max(gcs):.1f} ms" if gcs else ""))
    lines.append(f"  VRAM slots {d['vram_slots']}, RAM slots {d['ram_slots']}"
                 + (f", VRAM peak {d['vram_peak_bytes'] / 2**30:.2f} GiB (the allocator held {d['vram_held_peak_bytes'] / 2**30:.2f})"
                    if "vram_peak_bytes" in d else "") + _flushes(d.get("allocator_flushes", 0)))
    if "disk_roofline_ms_per_token" in d:
        lines.append(f"  disk reads {d['disk_reads_per_token']:.2f} blocks/token (demand and prefetch); a read on the drive "
                     f"{d['disk_busy_ms_per_token']:.2f} ms/token, {d['disk_busy_share']:.0%} of the decode time")
        lines.append(f"  {read_times(d)}")
        roof = max(d['disk_roofline_ms_per_token'], 1e-9)  # a mean over the run's tokens: its reads come early, as the cache fills
        lines.append(f"  disk + PCIe roofline {d['disk_roofline_ms_per_token']:.2f} ms/token (disk {d['disk_gbps']:.2f} GB/s measured now, reads without checksums): "
                     f"median step {d['ms_per_token_median'] / roof:.2f} x, mean step {d['ms_per_token_mean'] / roof:.2f} x")
    if d.get("roofline_ms_per_token"):
        lines.append(f"  roofline {d['roofline_ms_per_token']:.2f} ms/token (PCIe bytes / {d['h2d_gbps']:.1f} GB/s measured now): "
                     f"{d['ms_per_token_median'] / max(d['roofline_ms_per_token'], 1e-9):.2f} x roofline")
    if d.get("hybrid_roofline_ms_per_token"):
        lines.append(f"  hybrid roofline {d['hybrid_roofline_ms_per_token']:.2f} ms/token (blocks from RAM over PCIe and the CPU's "
                     f"rates together): {d['ms_per_token_median'] / d['hybrid_roofline_ms_per_token']:.2f} x")
    return "\n".join(lines)


def _flushes(n: int) -> str:
    return f"; the allocator flushed its cache {n} times at the budget's cap" if n else ""


def resident_roofline(d: dict, resident_ms: float | None, how: str = "GPU time") -> str:
    """Add to a bench's decode figures `d` the roofline of the performance issue: the PCIe time of the bytes moved
    per token plus the resident part's own time, `how` it was measured (its GPU time from `profile_decode`'s split,
    or "alone": decode steps of schedules/resident-alone.yaml); returns the line that reports it."""
    if "roofline_ms_per_token" not in d or resident_ms is None:
        return ""
    key = "alone" if how == "alone" else "gpu"
    d[f"resident_{key}_ms_per_token"] = resident_ms
    d[f"pcie_plus_resident_{key}_ms_per_token"] = roof = d["roofline_ms_per_token"] + resident_ms
    line = (f"roofline with the resident part ({how}): PCIe {d['roofline_ms_per_token']:.2f} + resident {resident_ms:.2f} = "
            f"{roof:.2f} ms/token; decode median {d['ms_per_token_median']:.2f} ms is {d['ms_per_token_median'] / roof:.2f} x")
    if "hybrid_roofline_ms_per_token" in d:  # the CPU's share: its split of the RAM blocks, in series with the resident part
        d[f"hybrid_plus_resident_{key}_ms_per_token"] = both = d["hybrid_roofline_ms_per_token"] + resident_ms
        line += (f"\n  with the CPU's share: hybrid {d['hybrid_roofline_ms_per_token']:.2f} + resident {resident_ms:.2f} = "
                 f"{both:.2f} ms/token; decode median {d['ms_per_token_median'] / both:.2f} x")
    unread = d.get("unread_guesses_ms_per_token", 0.0)
    if unread > 0:  # the stricter roofline: only the bytes the steps read
        strict = roof - unread
        d[f"read_pcie_plus_resident_{key}_ms_per_token"] = strict
        line += (f"\n  without the guesses copied ahead but never read ({unread:.2f} ms): {strict:.2f} ms/token, "
                 f"{d['ms_per_token_median'] / strict:.2f} x")
    if "disk_roofline_ms_per_token" in d:  # blocks read from disk too (a cold run): their time counted the same way
        d[f"disk_plus_resident_{key}_ms_per_token"] = roof = d["disk_roofline_ms_per_token"] + resident_ms
        line += (f"\n  with disk reads: disk + PCIe {d['disk_roofline_ms_per_token']:.2f} + resident {resident_ms:.2f} = {roof:.2f} "
                 f"ms/token; median step {d['ms_per_token_median'] / roof:.2f} x, mean step {d['ms_per_token_mean'] / roof:.2f} x "
                 f"(the disk reads are the run's mean per token)")
        unused = d.get("unread_guess_reads_ms_per_token", 0.0) + d.get("unread_guesses_ms_per_token", 0.0)
        if unused > 0:  # the stricter roofline: only the blocks the steps used
            strict = roof - unused
            d[f"used_disk_plus_resident_{key}_ms_per_token"] = strict
            line += (f"\n  without the guesses read or copied but never used ({unused:.2f} ms): {strict:.2f} ms/token; median step "
                     f"{d['ms_per_token_median'] / strict:.2f} x, mean step {d['ms_per_token_mean'] / strict:.2f} x")
    return line


def read_times(d: dict) -> str:
    """A bench's decode reads by kind: mean ms on the drive and queued before it."""
    kinds = [f"a {kind} {d[f'{kind}_read_drive_ms']:.2f} ms on the drive (queued {d[f'{kind}_read_queued_ms']:.2f} ms)"
             for kind in ("demand", "guess") if d.get(f"{kind}_read_drive_ms") is not None]
    return "reads: " + (", ".join(kinds) if kinds else "none timed")


def format_compare(results: list[tuple[str, dict]], block_bytes: int, ram_read: float) -> str:
    """Schedules side by side (`sluice bench model --compare`): decode, prefill, where blocks came from, blocks
    copied into the VRAM tier ahead of use (guesses, hot-set refreshes), and the bandwidths measured in the
    same run (pinned host-to-device, host RAM read, the hybrid path's CPU rate)."""
    lengths = list(results[0][1]["prefill"])
    head = (f"{'schedule':14} {'median ms':>9} {'mean ms':>8} {'1st ms':>7} {'rest ms':>7} {'tok/s':>7} {'x roofline':>10} "
            + " ".join(f"{'prefill ' + str(n):>15}" for n in lengths)
            + f" {'VRAM/RAM/disk/CPU blocks per token':>36} {'to VRAM':>7} {'hit':>6} {'stall ms':>8} {'ids ms':>7} {'drive':>6}")
    lines = [routing_line(results[0][1]), head]
    for name, r in results:
        d = r["decode"]
        b = d["blocks_per_token"]
        roof = f"{d['ms_per_token_median'] / d['roofline_ms_per_token']:.2f}" if d.get("roofline_ms_per_token") else "-"
        hit = f"{d['hit_rate']:.1%}" if d["hit_rate"] is not None else "n/a"
        tiers = f"{b['vram']:.2f} / {b['ram']:.2f} / {b['disk']:.2f} / {d['cpu_blocks_per_token']:.2f}"
        lines.append(f"{name:14} {d['ms_per_token_median']:9.2f} {d['ms_per_token_mean']:8.2f} {d['ms_first_token']:7.1f} "
                     f"{d['ms_per_token_mean_after_first']:7.2f} {d['tok_s']:7.1f} {roof:>10} "
                     + " ".join(f"{r['prefill'][n]['tok_s']:>7.0f}/{r['prefill'][n]['next']['tok_s']:<7.0f}" for n in lengths)
                     + f" {tiers:>36} {d['vram_prefetches_per_token'] + d['vram_fills_per_token']:7.2f} {hit:>6} {d['stall_ms_per_token']:8.2f} {d['ids_wait_ms_per_token']:7.2f}"
                     f" {d['disk_busy_share']:6.0%}")
    rates = [f"host RAM read {ram_read / 1e9:.1f} GB/s"]
    h2d = [r["decode"]["h2d_gbps"] for _, r in results if "h2d_gbps" in r["decode"]]
    if h2d:
        rates.append(f"pinned host-to-device {min(h2d):.1f}-{max(h2d):.1f} GB/s")
    cpu = [(n, r["cpu_gbps"]) for n, r in results if r.get("cpu_gbps")]
    rates += [f"{n}: CPU experts {g:.2f} GB/s" for n, g in cpu]
    lines.append("prefill tok/s: a prompt on the VRAM tier as opened / the next prompt (other ids) on the tier it left; drive: the "
                 "share of the decode time with a block read on the drive")
    lines += [f"{name}: decode {read_times(r['decode'])}" for name, r in results if r["decode"]["disk_busy_ms_per_token"]]
    lines.append(f"measured in this run: {', '.join(rates)}; block {block_bytes:,} bytes")
    return "\n".join(lines)


def accelerate_baseline(path, budget: int, prompt_len: int = 32, decode_tokens: int = 16, seed: int = 0) -> dict:
    """transformers + accelerate offloading on the same checkpoint: device_map="auto" with max_memory at
    the budget (what does not fit stays in CPU RAM and is copied in per forward). Greedy decode after a
    `prompt_len` prompt, each step timed as `bench_model` times Sluice's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(path).vocab_size
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", device_map="auto",
                                                 max_memory={0: budget, "cpu": f"{available_gib()}GiB"}).eval()
    load_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, prompt_len), generator=g).to("cuda")
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(decode_tokens):
            t = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            token.item()
            times.append(time.perf_counter() - t)
    times.sort()
    on_gpu = sum(1 for d in model.hf_device_map.values() if str(d) in ("0", "cuda", "cuda:0"))
    return {"load_s": load_s, "ms_per_token_median": 1000 * times[len(times) // 2], "tok_s": len(times) / sum(times),
            "vram_peak_bytes": torch.cuda.max_memory_allocated(), "device_map_gpu_entries": on_gpu,
            "device_map_entries": len(model.hf_device_map)}


def available_gib() -> int:
    from sluice.pipeline.config import available_ram

    return max(1, available_ram() // 2**30 - 4)
