"""On the GPU machine (.ci/gpu-day PART=two): why the server's worker decodes one client slower than `bench model` on
the same engine: the engine's own one-token steps timed beside the worker's, then the worker's thread profiled."""
import cProfile
import io
import pstats
import sys
import time

import torch

import sluice
from sluice.api import worker as W
from sluice.benchmarks.load import bench_load

with sluice.load(sys.argv[1], vram_budget="8GiB", routing="skewed", schedule="direct", max_batch=16) as e:
    bench_load(e, 1, 1, 64, 64, None)  # warm: kernels compiled, graphs captured, the VRAM tier settled
    seq = e.new_sequence()
    ids = torch.randint(3, 1000, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    t = time.perf_counter()
    tok = int(e.extend(seq, ids, last=True)[-1].argmax())
    prompt_ms, ts = 1000 * (time.perf_counter() - t), []
    for _ in range(32):
        a = time.perf_counter()
        tok = int(e.extend(seq, [tok])[-1].argmax())
        ts.append(1000 * (time.perf_counter() - a))
    e.release(seq)
    print(f"engine alone: prompt 64 {prompt_ms:.1f} ms; token median {sorted(ts)[16]:.2f} ms, first {ts[0]:.1f} ms")
    for mb in (1, 16):
        r = bench_load(e, 1, mb, 64, 32, None)
        print(f"worker, max batch {mb}: first token {r['ttft_median_s'] * 1000:.0f} ms, {r['per_client_tok_s']:.1f} tok/s")
    prof, run = cProfile.Profile(), W.EngineWorker._run
    W.EngineWorker._run = lambda self: prof.runcall(run, self)
    r = bench_load(e, 1, 16, 64, 32, None)
    print(f"worker profiled, max batch 16: first token {r['ttft_median_s'] * 1000:.0f} ms, {r['per_client_tok_s']:.1f} tok/s")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(16)
    print(out.getvalue()[-4500:])
