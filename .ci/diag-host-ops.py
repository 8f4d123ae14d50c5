"""On the GPU machine: the VRAM tier refresh's host selection (storage/vram_tier.py) on Qwen3-30B-A3B's counts [48, 128]
with 1419 blocks inside, in torch's CPU ops (as before 2026-12-07) against numpy (as now), CUDA initialised, the counts
copied from the GPU as a refresh reads them; each median of 20 in ms, with torch's threads as set and with one."""
import statistics
import time

import numpy as np
import torch


def with_torch(uses, last, score, inside_ids):
    score = score * 0.5 + (uses - last).double()
    flat = score.flatten()
    s = flat.tolist()
    inside = torch.zeros(flat.numel(), dtype=torch.bool)
    inside[torch.tensor(inside_ids)] = True
    order = torch.argsort(flat, descending=True, stable=True)
    return order[~inside[order] & (flat[order] > 0)].tolist(), order[inside[order]].flip(0).tolist(), s


def with_numpy(uses, last, score, inside_ids):
    score = score * 0.5 + (uses - last)
    flat = score.ravel()
    s = flat.tolist()
    inside = np.zeros(flat.size, dtype=bool)
    inside[inside_ids] = True
    order = np.argsort(-flat, kind="stable")
    return order[~inside[order] & (flat[order] > 0)].tolist(), order[inside[order]][::-1].tolist(), s


g = torch.Generator().manual_seed(0)
dev_uses = torch.randint(0, 40, (48, 128), generator=g).cuda()
ids = torch.randperm(48 * 128, generator=g)[:1419].tolist()
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    for name, fn, conv in (("torch", with_torch, lambda t: t), ("numpy", with_numpy, lambda t: t.numpy())):
        ts = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            u = conv(dev_uses.to("cpu", copy=True))
            out = fn(u, conv(torch.zeros(48, 128, dtype=torch.int64)), conv(torch.zeros(48, 128, dtype=torch.float64)), ids)
            ts.append(1000 * (time.perf_counter() - t))
        print(f"{name:6s} threads {threads:2d}: median {statistics.median(ts):8.3f} ms, max {max(ts):8.3f} ms")
a = with_torch(dev_uses.cpu(), torch.zeros(48, 128, dtype=torch.int64), torch.zeros(48, 128, dtype=torch.float64), ids)
b = with_numpy(dev_uses.cpu().numpy(), np.zeros((48, 128), dtype=np.int64), np.zeros((48, 128)), ids)
print("same selection:", a[0] == b[0] and a[1] == b[1] and a[2] == b[2])
# which of torch's CPU ops is slow with its threads: each alone, median of 20 in ms (threads as set, then one)
u, z, f = dev_uses.cpu(), torch.zeros(48, 128, dtype=torch.int64), torch.zeros(48, 128, dtype=torch.float64)
flat = f.flatten()
ops = {"score arithmetic": lambda: f * 0.5 + (u - z).double(), "tolist": lambda: flat.tolist(),
       "zeros bool": lambda: torch.zeros(flat.numel(), dtype=torch.bool), "tensor(list)": lambda: torch.tensor(ids),
       "argsort": lambda: torch.argsort(flat, descending=True, stable=True), "unique": lambda: torch.unique(u.flatten()),
       "bincount": lambda: torch.bincount(u.flatten(), minlength=128), "mask index": lambda: flat[flat > 0]}
for threads in (16, 1):
    torch.set_num_threads(threads)
    line = []
    for name, op in ops.items():
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            op()
            ts.append(1000 * (time.perf_counter() - t))
        line.append(f"{name} {statistics.median(ts):.3f}")
    print(f"threads {threads:2d}: " + ", ".join(line))
