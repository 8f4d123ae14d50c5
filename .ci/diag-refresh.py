"""On the GPU machine (.ci/gpu-day PART=noise): where the VRAM tier's refresh spends its host time (13-23 ms a refresh
on Qwen3-30B-A3B at 8 and 16 GiB, 2026-12-07, against ~1 ms on a CPU): each refresh's parts timed with the GPU synced
around it, then the refreshes profiled. argv: STORE [BUDGET] [ROUTING]."""
import cProfile
import io
import pstats
import sys
import threading
import time

import torch

import sluice
from sluice.storage.vram_tier import VramTier

store, budget, routing = sys.argv[1], (sys.argv[2:3] or ["8GiB"])[0], (sys.argv[3:4] or ["skewed"])[0]
with sluice.load(store, vram_budget=budget, routing=routing, schedule="direct") as e:
    tier = e.coordinator.plan.table.tier
    prof, refresh, timed = cProfile.Profile(), VramTier.refresh, []

    def timed_refresh(self, uses=None):
        torch.cuda.synchronize()
        for tid, frame in sys._current_frames().items():  # the other Python threads, where they are (GIL contention?)
            if tid != threading.get_ident():
                seen.add(f"{names.get(tid, tid)}: {frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        t = time.perf_counter()
        prof.runcall(refresh, self, uses)
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        moves = len(self.landing[1]) if self.landing else 0
        timed.append((1000 * host, 1000 * (time.perf_counter() - t), moves))

    seen, names = set(), {t.ident: t.name for t in threading.enumerate()}
    VramTier.refresh = timed_refresh
    seq = e.new_sequence()
    tok = int(e.extend(seq, torch.randint(3, 1000, (32,), generator=torch.Generator().manual_seed(5)).tolist())[-1].argmax())
    steps = []
    for _ in range(96):
        a = time.perf_counter()
        tok = int(e.extend(seq, [tok])[-1].argmax())
        steps.append(1000 * (time.perf_counter() - a))
    e.release(seq)
    print(f"{store} {budget} {routing}: token median {sorted(steps)[48]:.2f} ms; steps over 2 x median: "
          + ", ".join(f"#{k} {s:.1f}" for k, s in enumerate(steps) if s > 2 * sorted(steps)[48]))
    for host, synced, moves in timed:
        print(f"  refresh: host {host:.2f} ms, to the copies' end {synced:.2f} ms, {moves} blocks copied")
    print(f"  other threads at refreshes (switch interval {sys.getswitchinterval() * 1000:.0f} ms): " + "; ".join(sorted(seen))[:900])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print(out.getvalue()[-3500:])
