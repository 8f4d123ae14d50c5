"""`sluice bench batch`: decode speed with several sequences in one step (Engine.extend_many), per batch size:
aggregate and per-sequence tokens per second and routed expert bytes per generated token, under the routing
setting given (a figure that depends on routing says which).

First one sequence decodes `--warm-tokens` untimed (the VRAM tier settles on the routing, as a conversation's first
turns leave it). Each batch size gets fresh sequences of random prompts, two untimed steps (the first runs layer by
layer and compiles kernels, the second captures the step whole where it can be), then `--decode-tokens` timed steps
of greedy decode; batch size 1 runs the ordinary one-token step (`extend`), the baseline the others are compared with.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch


def add_batch_parser(bsub) -> None:
    from sluice.options import engine_args

    bb = bsub.add_parser("batch", help="decode with several sequences per step: aggregate and per-sequence tok/s, "
                                       "expert bytes per token, per batch size")
    engine_args(bb)
    bb.add_argument("--batches", default="1,2,4,8", help="comma-separated batch sizes (default: %(default)s)")
    bb.add_argument("--prompt-length", type=int, default=32)
    bb.add_argument("--decode-tokens", type=int, default=16)
    bb.add_argument("--warm-tokens", type=int, default=64, help="one sequence's tokens decoded first, untimed, so that every "
                                                                "row meets a VRAM tier settled on the routing (default: %(default)s)")
    bb.add_argument("--json", type=Path, help="also write the rows as JSON")
    bb.add_argument("--profile", action="store_true", help="also profile steps of the largest batch: host functions and "
                                                           "GPU busy time, per generated token")
    bb.set_defaults(func=cmd_bench_batch)


def decoding(engine, batch: int, prompt_length: int, seed: int = 0):
    """`batch` fresh sequences of random prompts and a step() that decodes one greedy token for each (`extend` for
    one sequence, `extend_many` for more), its first two (untimed) calls made: the first compiles its kernels, the
    second captures the whole step (pipeline/whole.py)."""
    g = torch.Generator().manual_seed(seed + batch)
    vocab = engine.model.config.vocab_size
    seqs = [engine.new_sequence() for _ in range(batch)]
    last = [int(engine.extend(s, torch.randint(3, vocab, (prompt_length,), generator=g).tolist(), last=True)[-1].argmax())
            for s in seqs]

    def step():
        rows = [engine.extend(seqs[0], last)] if batch == 1 else engine.extend_many(seqs, last)
        last[:] = [int(row[-1].argmax()) for row in rows]
    step.seqs = seqs  # to be released after the row (their states hold VRAM)
    step()
    step()
    return step


def bench_batch(engine, batch: int, prompt_length: int, tokens: int, seed: int = 0) -> dict:
    """One batch size: decode `tokens` steps of `batch` sequences; the rates and the expert bytes per token."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    step = decoding(engine, batch, prompt_length, seed)
    before = engine.rt.stats.snapshot()
    t = time.perf_counter()
    for _ in range(tokens):
        step()
    seconds = time.perf_counter() - t
    io = engine.rt.stats.since(before)
    release(engine, step)
    generated, block = batch * tokens, engine.store.block_bytes
    blocks = sum(io["blocks"].values())
    # blocks that crossed PCIe: those read outside VRAM less the CPU's share, and the hot set's refreshes
    moved = (io["blocks"]["ram"] + io["blocks"]["disk"] - io["cpu_blocks"] + io["vram_fills"] + io["vram_prefetches"]) * block
    row = {"batch": batch, "aggregate_tok_s": generated / seconds, "per_sequence_tok_s": tokens / seconds,
           "step_ms": 1000 * seconds / tokens, "expert_bytes_per_token": blocks * block / generated,
           "pcie_bytes_per_token": moved / generated,
           "disk_blocks_per_token": io["blocks"]["disk"] / generated, "vram_share": io["blocks"]["vram"] / max(blocks, 1)}
    if cuda:  # the most VRAM the row's allocator held (read before the PCIe rate's buffer), and the step's PCIe floor
        row["vram_peak_bytes"] = torch.cuda.max_memory_reserved(engine.device)
        row["roofline_step_ms"] = 1000 * moved / tokens / engine.rt.h2d_rate()
    return row


def release(engine, step) -> None:
    """The sequences of a `decoding` step given back to the engine."""
    for s in step.seqs:
        engine.release(s)


def _row(engine, batch: int, prompt_length: int, tokens: int) -> dict:
    """bench_batch's row, or where the batch's states and steps do not fit the VRAM budget, a row saying so (the
    other rows stand)."""
    try:
        return bench_batch(engine, batch, prompt_length, tokens)
    except torch.OutOfMemoryError as e:
        error = f"out of VRAM: {str(e).splitlines()[0][:120]}"
    gc.collect()  # the failed step's tensors, held by the exception until now
    torch.cuda.empty_cache()
    return {"batch": batch, "error": error}


def format_rows(rows: list[dict]) -> str:
    base = rows[0].get("aggregate_tok_s") if rows and rows[0]["batch"] == 1 else None
    lines = ["batch | aggregate tok/s | per sequence tok/s | step ms | PCIe floor ms | expert MB / token | PCIe MB / token | "
             "from VRAM | disk blocks / token | VRAM peak GiB | x batch 1"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['batch']:5d} | {r['error']}")
            continue
        ratio = f"{r['aggregate_tok_s'] / base:.2f}" if base else "-"
        floor = f"{r['roofline_step_ms']:13.2f}" if "roofline_step_ms" in r else f"{'-':>13}"
        peak = f"{r['vram_peak_bytes'] / 2**30:13.2f}" if "vram_peak_bytes" in r else f"{'-':>13}"
        lines.append(f"{r['batch']:5d} | {r['aggregate_tok_s']:15.1f} | {r['per_sequence_tok_s']:18.1f} | {r['step_ms']:7.2f} | "
                     f"{floor} | {r['expert_bytes_per_token'] / 1e6:17.2f} | {r['pcie_bytes_per_token'] / 1e6:15.2f} | "
                     f"{r.get('vram_share', 0):9.0%} | {r['disk_blocks_per_token']:19.2f} | {peak} | {ratio}")
    return "\n".join(lines)


def cmd_bench_batch(args) -> int:
    from sluice.benchmarks.model import routing_line, routing_name, synthetic_weights
    from sluice.benchmarks.profile import profile_steps
    from sluice.options import counts, open_engine

    sizes = counts("--batches", args.batches)
    with open_engine(args, max_batch=max(sizes)) as engine:
        r = {"routing": routing_name(engine), "synthetic_weights": synthetic_weights(engine), "warm_tokens": args.warm_tokens}
        if args.warm_tokens > 0:
            step = decoding(engine, 1, args.prompt_length, seed=-1)
            for _ in range(args.warm_tokens):
                step()
            release(engine, step)
        r["rows"] = [_row(engine, b, args.prompt_length, args.decode_tokens) for b in sizes]
        print(f"{engine.store.path} on {engine.device} | schedule {engine.coordinator.schedule.name}")
        print(routing_line(r))
        print(format_rows(r["rows"]))
        ran = [row["batch"] for row in r["rows"] if "error" not in row]
        if args.profile and ran:
            print(f"profile of {max(ran)} sequences a step, per generated token:")
            print(profile_steps(engine, decoding(engine, max(ran), args.prompt_length, seed=1), max(ran), 4))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0
