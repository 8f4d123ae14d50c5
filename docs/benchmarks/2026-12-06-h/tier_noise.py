"""The VRAM tier's refresh rule (storage/vram_tier.py `VramTier.refresh`) replayed offline on the controlled routings:
PCIe blocks a token (RAM reads + copies into the tier) under `margin` alone and with `noise`, per shape and budget.

    PYTHONPATH=<folder holding sluice> python docs/benchmarks/2026-12-06-h/tier_noise.py
"""
import math

import numpy as np

from sluice.storage.routing import for_shape, parse_routing, routing_tables

E = 128


def replay(ids, slots: int, margin: float, noise: float, refresh: int = 16, decay: float = 0.5, settle: int = 200):
    """(VRAM hits, RAM reads, copies, PCIe blocks) a token after `settle` tokens."""
    N, L, K = ids.shape
    score, uses, inside = np.zeros(L * E), np.zeros(L * E), np.zeros(L * E, bool)
    hits = reads = copies = 0
    for t in range(N):
        flat = (ids[t].numpy() + np.arange(L)[:, None] * E).ravel()
        if t >= settle:
            h = int(inside[flat].sum())
            hits, reads = hits + h, reads + len(flat) - h
        np.add.at(uses, flat, 1)
        if (t + 1) % refresh:
            continue
        score, uses[:] = score * decay + uses, 0
        order = np.argsort(-score, kind="stable")
        outside = order[~inside[order] & (score[order] > 0)]
        free = slots - int(inside.sum())
        come = list(outside[:free])
        for j, k in zip(outside[free:], order[inside[order]][::-1]):
            if score[j] - score[k] <= margin + noise * math.sqrt(score[j] + score[k]):
                break
            come.append(j)
            inside[k] = False
        inside[come] = True
        copies += len(come) if t >= settle else 0
    n = N - settle
    return hits / n, reads / n, copies / n, (reads + copies) / n


for shape, L, K, slots in (("Nano 8 GiB", 23, 6, 429), ("Qwen3 8 GiB", 48, 8, 1419), ("Nano 16 GiB", 23, 6, 1768)):
    for kind in ("uniform", "skewed"):
        ids = routing_tables(for_shape(parse_routing(kind), E, K), L, E, K)[0][:3000]
        (_, _, c0, p0), (_, _, c1, p1) = replay(ids, slots, 1.0, 0.0), replay(ids, slots, 1.0, 1.5)
        print(f"{shape:12} {kind:8} margin only: {p0:6.1f} PCIe blocks/token ({c0:5.2f} copies); with noise 1.5: "
              f"{p1:6.1f} ({c1:5.2f} copies): {p1 / p0 - 1:+.0%}")
