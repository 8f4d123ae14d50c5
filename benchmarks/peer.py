"""`sluice bench peer`: Sluice and llama.cpp on the same shape, VRAM budget and machine, in one run, in one table.

Each engine runs in a process of its own (a VRAM budget caps a whole process), one after another: llama-bench's three
placements (benchmarks/llama.py), then `sluice bench model` for each routing setting and schedule asked for, and, for
the roofline's resident term, the resident part alone (schedules/resident-alone.yaml). The pinned host-to-device and
host RAM read rates are measured in the same run. Ratios are against llama.cpp's `-ncmoe` placement at the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from sluice.benchmarks.gpu_memory import PeakMemory
from sluice.benchmarks.llama import gguf_sizes, ncmoe_for, run_llama_bench
from sluice.errors import SluiceError
from sluice.pipeline.config import parse_size
from sluice.storage.routing import split_settings

CPU_EXPERTS = ["-ot", "exps=CPU", "-lm", "none"]  # routed experts in RAM, computed by the CPU (not mmap'd: pinned)


def run_peer(args) -> dict:
    from sluice.kernels.rates import h2d_bandwidth, ram_read_bandwidth

    budget = parse_size(args.vram_budget, "--vram-budget")
    prompts = [int(x) for x in args.prompt_lengths.split(",") if x]
    out: dict = {"store": str(args.model), "gguf": str(args.gguf), "vram_budget": budget, "prompts": prompts,
                 "decode_tokens": args.decode_tokens, "llama": [], "sluice": []}
    from sluice.storage.home import resolve_store
    from sluice.storage.store import ExpertStore

    store = ExpertStore.open(resolve_store(args.model))
    out["expert_format"] = "/".join(sorted({f.kind for f in store.manifest.formats.values()})).upper()
    cuda = torch.cuda.is_available()
    out["h2d_gbps"] = h2d_bandwidth(torch.device("cuda")) / 1e9 if cuda else None
    out["ram_read_gbps"] = ram_read_bandwidth() / 1e9
    if args.gguf:
        out["llama"] = [vars(r) for r in _llama_runs(args, budget, prompts)]
        _save(args, out)
    for routing in split_settings(args.routing):
        for schedule in args.schedules.split(","):
            out["sluice"].append(_sluice_run(args, routing, schedule))
            print(format_row(out["sluice"][-1]), flush=True)
            _save(args, out)
    if args.resident_alone:
        out["resident_alone"] = _sluice_run(args, split_settings(args.routing)[0], "resident-alone")
    return out


def _save(args, out: dict) -> None:
    """The JSON so far, rewritten after every run: a run cut off by a time limit keeps what it measured."""
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _llama_runs(args, budget: int, prompts: list[int]):
    sizes = gguf_sizes(args.gguf)
    run = lambda name, extra: run_llama_bench(args.llama_bench, args.gguf, name, extra, prompts, args.decode_tokens,  # noqa: E731
                                              args.threads, args.reps, PeakMemory())
    runs = [run("all on the GPU", []), cpu := run("experts on the CPU", CPU_EXPERTS)]
    overhead = (cpu.vram_peak - sizes.other) if cpu.vram_peak is not None else 1 << 30  # what is not weights
    n = ncmoe_for(sizes, budget, max(overhead, 0))
    runs.append(run(f"-ncmoe {n} (budget)", ["-ncmoe", str(n), "-lm", "none"]))
    for r in runs:
        print(f"llama.cpp {r.placement}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in r.tok_s.items())
              + (f", VRAM {r.vram_peak / 2**30:.2f} GiB" if r.vram_peak is not None else ""), flush=True)
    return runs


def _sluice_run(args, routing: str, schedule: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "sluice.cli", "bench", "model", "--model", str(args.model), "--device", args.device,
               "--routing", routing, "--schedule", schedule, "--prompt-lengths", args.prompt_lengths,
               "--decode-tokens", str(args.decode_tokens), "--json", str(path)]
        if args.device != "cpu":  # a static cache for the longest prompt and its decode: one-token steps replay whole
            longest = max(int(n) for n in args.prompt_lengths.split(",") if n)
            cmd += ["--vram-budget", args.vram_budget, "--static-kv", str(longest + args.decode_tokens + 64)]
        with PeakMemory() as peak:
            done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if done.returncode != 0:
            raise SluiceError(f"sluice bench model ({schedule}, {routing}) failed: {done.stderr.strip()[-600:]}")
        r = json.loads(path.read_text())
    return {"schedule": schedule, "routing": r["routing"], "vram_peak": peak.bytes, "bench": r}


def _ms(x) -> str:
    return f"{x:.2f}" if x is not None else "-"


def format_row(s: dict) -> str:
    d = s["bench"]["decode"]
    return (f"sluice {s['schedule']} ({s['routing']}): decode {d['tok_s']:.1f} tok/s (median {d['ms_per_token_median']:.2f} ms), "
            + ", ".join(f"pp{n} {p['tok_s']:.0f}" for n, p in s["bench"]["prefill"].items()))


def format_table(out: dict, title: str) -> str:
    """One markdown table: llama.cpp's placements, then Sluice's rows with their ratios to llama.cpp at the budget and
    their decode roofline (PCIe bytes / H2D measured now, plus the resident part's own time where measured)."""
    prompts = out["prompts"]
    tests = [f"pp{n}" for n in prompts]
    budget_row = next((r for r in out["llama"] if "budget" in r["placement"]), None)
    alone = out.get("resident_alone")
    resident = alone["bench"]["decode"]["ms_per_token_median"] if alone else None
    head = ["engine", "placement / schedule", "routing", "decode tok/s", *[f"prefill {n} tok/s" for n in prompts],
            "x llama.cpp (decode / " + " / ".join(tests) + ")", "decode ms (median)", "roofline ms", "x roofline", "VRAM GiB"]
    rows = []
    tg = f"tg{out['decode_tokens']}"
    for r in out["llama"]:
        t = r["tok_s"]
        rows.append(["llama.cpp Q4_K_M", r["placement"], "its weights' (near uniform)", f"{t.get(tg, 0):.1f}",
                     *[f"{t.get(k, 0):.0f}" for k in tests], "", "", "", "", _gib(r["vram_peak"])])
    for s in out["sluice"]:
        d, p = s["bench"]["decode"], s["bench"]["prefill"]
        ratio = ""
        if budget_row is not None:
            t = budget_row["tok_s"]
            parts = [d["tok_s"] / t[tg]] + [p[str(n)]["tok_s"] / t[f"pp{n}"] for n in prompts]
            ratio = " / ".join(f"{x:.2f}" for x in parts)
        roof = d.get("roofline_ms_per_token")
        roof = roof + resident if roof is not None and resident is not None else roof
        rows.append([f"Sluice {out['expert_format']}", s["schedule"], s["routing"], f"{d['tok_s']:.1f}", *[f"{p[str(n)]['tok_s']:.0f}" for n in prompts],
                     ratio, _ms(d["ms_per_token_median"]), _ms(roof),
                     f"{d['ms_per_token_median'] / roof:.2f}" if roof else "-", _gib(s["vram_peak"])])
    rates = (f"pinned H2D {out['h2d_gbps']:.1f} GB/s, " if out.get("h2d_gbps") else "") + f"host RAM read {out['ram_read_gbps']:.1f} GB/s"
    lines = [f"{title}: VRAM budget {out['vram_budget'] / 2**30:.0f} GiB; {rates} (measured in this run)"
             + (f"; resident part alone {resident:.2f} ms/token" if resident else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if n is not None else "-"


def cmd_bench_peer(args) -> int:
    out = run_peer(args)
    table = format_table(out, args.title or Path(args.model).name)
    print(table)
    _save(args, dict(out, table=table))
    return 0


def add_peer_parser(bsub) -> None:
    bp = bsub.add_parser("peer", help="Sluice and llama.cpp on the same shape and VRAM budget, in one run, one table")
    bp.add_argument("--model", required=True, help="the Sluice expert store (or checkpoint) of the shape")
    bp.add_argument("--gguf", help="the same shape as a GGUF (../shared/peers/make_gguf.py); without it, Sluice alone")
    bp.add_argument("--llama-bench", default="llama-bench", help="the llama-bench binary")
    bp.add_argument("--vram-budget", default="8GiB", help="the GPU memory each engine may use (default: %(default)s)")
    bp.add_argument("--routing", default="uniform,skewed", help="Sluice's routing settings, comma-separated (default: %(default)s)")
    bp.add_argument("--schedules", default="direct,overlap", help="Sluice's schedules, comma-separated (default: %(default)s)")
    bp.add_argument("--prompt-lengths", default="512,2048", help="prefill lengths (default: %(default)s)")
    bp.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed (default: %(default)s)")
    bp.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's CPU threads (default: every core)")
    bp.add_argument("--reps", type=int, default=2, help="llama-bench repetitions (default: %(default)s)")
    bp.add_argument("--resident-alone", action="store_true", help="also time the resident part alone, for the roofline")
    bp.add_argument("--device", default="cuda", help="Sluice's device (default: %(default)s)")
    bp.add_argument("--title", help="the table's title (default: the store's name)")
    bp.add_argument("--json", help="also write every figure as JSON")
    bp.set_defaults(func=cmd_bench_peer)
