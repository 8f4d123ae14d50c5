"""`sluice bench gemv`: one-row linears of a model shape's resident part, F.linear (cuBLAS) against the one-launch
Triton GEMV (kernels/gemv.py) at several tiles and warps (and, with `--pdl`, launched as programmatic dependents):
microseconds a call and GB/s of weight read against the HBM rate.

Each row times a CUDA graph of calls over enough copies of the weight (together past the GPU's L2) that every call
reads its weight from HBM, as a token step does; the graph strips the host's launch cost, as a step replayed whole does.
"""

from __future__ import annotations

import torch

# (name, N, K): Nemotron-3-Nano-30B-A3B's one-token linears (BF16)
NANO = [("mamba in_proj", 10304, 2688), ("mamba out_proj", 2688, 4096), ("shared up", 3712, 2688),
        ("shared down", 2688, 3712), ("attn q", 4096, 2688), ("attn k / v", 256, 2688), ("attn o", 2688, 4096),
        ("lm_head", 131072, 2688)]
TILES = [(0, 0, 4), (2, 512, 4), (4, 256, 4), (8, 512, 4), (16, 256, 4), (4, 512, 8), (2, 1024, 4)]  # (BN, BK, warps)


def add_gemv_parser(bsub) -> None:
    bg = bsub.add_parser("gemv", help="one-row linears: cuBLAS against the Triton GEMV per tile, us and GB/s (CUDA)")
    bg.add_argument("--calls", type=int, default=20, help="calls a graph replays (default: %(default)s)")
    bg.add_argument("--pdl", action="store_true", help="also tile()'s choice launched as programmatic dependents (Hopper): "
                                                       "each call's launch under the one before")
    bg.set_defaults(func=cmd_bench_gemv)


def time_calls(fn, calls: int, reps: int = 20) -> float:
    """Microseconds a call: `calls` calls fn(i) captured in one CUDA graph, the median of `reps` replays."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def cmd_bench_gemv(args) -> int:
    import torch.nn.functional as F

    from sluice.kernels.gemv import gemv, gemv_ref, tile

    if not torch.cuda.is_available():
        raise SystemExit("bench gemv: needs CUDA")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name(0)}; L2 {l2 / 2**20:.0f} MiB; BF16; us a call (GB/s); tiles (BN, BK, warps), 0: tile()'s choice")
    print(f"{'linear':14} {'N':>6} {'K':>5} {'MB':>6} {'cuBLAS':>14} " + " ".join(f"{str(t):>14}" for t in TILES)
          + (f" {'pdl':>14}" if args.pdl else ""))
    for name, N, K in NANO:
        nbytes = N * K * 2
        copies = max(2, -(-3 * l2 // nbytes))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        x = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        err = (gemv(x, ws[0]).float() - gemv_ref(x, ws[0]).float()).abs().max().item()
        calls = max(args.calls, copies)  # every copy read once a replay: together they pass the L2
        cells = [time_calls(lambda i: F.linear(x, ws[i % copies]), calls)]
        cells += [time_calls(lambda i, t=t: gemv(x, ws[i % copies], bn=t[0], bk=t[1], num_warps=t[2]), calls) for t in TILES]
        if args.pdl:
            cells.append(time_calls(lambda i: gemv(x, ws[i % copies], pdl=True), calls))
        print(f"{name:14} {N:6} {K:5} {nbytes / 1e6:6.1f} " + " ".join(f"{us:6.2f} ({nbytes / us / 1e3:5.0f})" for us in cells)
              + f"  tile() {tile(N, K)}, max |err| {err:.1e}")
        del ws
    return 0
