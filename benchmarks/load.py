"""`sluice bench load`: the server's scheduler under N clients at once (api/worker.py, without HTTP): time to first
token, per-client and aggregate decode tok/s, per number of clients and `--max-batch`, under the routing setting
given (a figure that depends on routing says which).

Every client's request (a random prompt of `--prompt-length` tokens, `--decode-tokens` greedy tokens) is submitted
before the worker's first turn, as N clients arriving together. One request of `--warm-tokens` decoded tokens runs
first, untimed: kernels compiled, steps captured, and the VRAM tier settled on the routing, as a server's earlier
requests leave it (it refreshes every 16 one-token steps: a 4-token warm-up left it as the prompts had filled it).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import torch


def add_load_parser(bsub) -> None:
    from sluice.options import at_least, engine_args

    bl = bsub.add_parser("load", help="N clients at once through the server's worker: time to first token, per-client "
                                      "and aggregate tok/s, per --max-batch")
    engine_args(bl)
    bl.add_argument("--clients", default="1,4,16", help="comma-separated client counts (default: %(default)s)")
    bl.add_argument("--max-batch", default="1,16", help="comma-separated --max-batch values (default: %(default)s)")
    bl.add_argument("--step-tokens", type=int, help="the rows a shared step holds (default: the prefill chunk)")
    bl.add_argument("--prompt-length", type=int, default=64)
    bl.add_argument("--decode-tokens", type=int, default=32)
    bl.add_argument("--warm-tokens", type=at_least(2), default=64, help="a first request's tokens, untimed, so that the clients meet a "
                                                                "VRAM tier settled on the routing (default: %(default)s)")
    bl.add_argument("--json", type=Path, help="also write the rows as JSON")
    bl.set_defaults(func=cmd_bench_load)


def bench_load(engine, clients: int, max_batch: int, prompt_length: int, tokens: int, step_tokens: int | None,
               seed: int = 0) -> dict:
    """One setting: `clients` requests at once through a fresh worker; the time to first token and the rates."""
    from sluice.api.metrics import Metrics
    from sluice.api.snapshots import SnapshotStore
    from sluice.api.worker import EngineWorker, Job
    from sluice.pipeline.sampling import Sampler

    g = torch.Generator().manual_seed(seed + clients)
    vocab = engine.model.config.vocab_size
    worker = EngineWorker(engine, SnapshotStore(0), Metrics(), engine.prefill_chunk, max_batch, step_tokens)
    firsts, ends, done = [None] * clients, [None] * clients, threading.Semaphore(0)

    def emit(i):
        def on(ev):
            if ev[0] == "token" and firsts[i] is None:
                firsts[i] = time.perf_counter()
            elif ev[0] in ("done", "error"):
                ends[i] = time.perf_counter()
                done.release()
        return on

    jobs = [Job(torch.randint(3, vocab, (prompt_length,), generator=g).tolist(), tokens, Sampler(), frozenset(), emit(i))
            for i in range(clients)]
    t0 = time.perf_counter()
    for job in jobs:
        job.t_submit = t0
        worker.submit(job)
    worker.start()
    try:
        for _ in jobs:
            done.acquire()
    finally:
        worker.stop()
    seconds = max(ends) - t0
    ttft = [f - t0 for f in firsts]
    per_client = [(tokens - 1) / (e - f) for f, e in zip(firsts, ends) if e > f]
    return {"clients": clients, "max_batch": max_batch, "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "per_client_tok_s": statistics.median(per_client) if per_client else 0.0,
            "aggregate_tok_s": clients * tokens / seconds, "seconds": seconds}


def format_rows(rows: list[dict]) -> str:
    lines = ["clients | max batch | first token median s | max s | per client tok/s | aggregate tok/s | x 1 client"]
    base = {r["max_batch"]: r["aggregate_tok_s"] for r in rows if r["clients"] == 1}
    for r in rows:
        ratio = f"{r['aggregate_tok_s'] / base[r['max_batch']]:.2f}" if r["max_batch"] in base else "-"
        lines.append(f"{r['clients']:7d} | {r['max_batch']:9d} | {r['ttft_median_s']:20.2f} | {r['ttft_max_s']:5.2f} | "
                     f"{r['per_client_tok_s']:16.1f} | {r['aggregate_tok_s']:15.1f} | {ratio}")
    return "\n".join(lines)


def cmd_bench_load(args) -> int:
    from sluice.benchmarks.model import routing_line, routing_name, synthetic_weights
    from sluice.options import counts, open_engine

    clients, batches = counts("--clients", args.clients), counts("--max-batch", args.max_batch)
    with open_engine(args, max_batch=max(batches)) as engine:
        r = {"routing": routing_name(engine), "synthetic_weights": synthetic_weights(engine)}
        bench_load(engine, 1, 1, args.prompt_length, args.warm_tokens, None)  # warm (module docstring)
        r["rows"] = [bench_load(engine, c, b, args.prompt_length, args.decode_tokens, args.step_tokens)
                     for b in batches for c in clients]
        print(f"{engine.store.path} on {engine.device} | schedule {engine.coordinator.schedule.name} | prompt "
              f"{args.prompt_length} tokens, {args.decode_tokens} decoded, prefill chunk {engine.prefill_chunk}")
    print(routing_line(r))
    print(format_rows(r["rows"]))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0
