"""`sluice bench kernels --rows T...`: a batched decode step's grouped expert kernels (TritonExperts.run_rows) over T
rows, every block read zero-copy from pinned host memory, per tile configuration (compute's `rows_tile`), against
the PCIe floor of the distinct blocks they read."""

from __future__ import annotations

import torch

from sluice.benchmarks.kernels import SHAPES, ceilings, make_banks, time_calls

ROWS_TILES = [(0, 0, 0), (64, 128, 4), (64, 128, 8), (64, 64, 4), (32, 128, 4), (32, 256, 4), (128, 64, 4), (64, 256, 8),
              (32, 64, 4)]  # (bn, bk, warps) of a batched step's grouped GEMMs; 0s: their defaults


def bench_rows(shape="nano", fmt="nvfp4", batches=(2, 8, 16), experts=128, device="cuda") -> tuple[dict, list[str]]:
    """A batched decode step's routed experts for one MoE layer (TritonExperts.run_rows: up, then the weighted down,
    grouped by expert on the device) over T rows routed uniformly at random, every block read zero-copy from pinned
    host memory, per tile configuration; against the PCIe floor (the distinct blocks' bytes over the pinned
    host-to-device rate). Lines of a table."""
    from sluice.kernels.experts import TritonExperts

    device = torch.device(device)
    ceil = ceilings(device)
    kind, Dx, I, K = SHAPES[shape]
    hbanks, L, block_bytes = make_banks(kind, fmt, Dx, I, experts, device, pin=True)
    kern = TritonExperts.__new__(TritonExperts)  # only what run_rows reads: the layouts, the kind, the activation
    kern.layouts, kern.kind, kern.act, kern.act_args = L, kind, 0 if kind == "relu2" else 1, (0.0, 0.0)
    base = torch.empty(1, dtype=torch.uint8, device=device)
    nbytes = L["up"].nbytes + L["down"].nbytes + (L["gate"].nbytes if "gate" in L else 0)
    lines = [f"{'shape':6} {'T':>3} {'distinct':>8} {'tile':>12} {'us':>9} {'PCIe floor us':>13} {'x floor':>8}"]
    g = torch.Generator().manual_seed(0)
    for T in batches:
        ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(T)]).to(device)
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        distinct = int((counts > 0).sum())
        floor = distinct * nbytes / (ceil["h2d"] * 1e3)
        xe = torch.randn(T, Dx, device=device, dtype=torch.bfloat16)
        w = torch.rand(T, K, device=device)
        y = torch.empty(T * K, Dx, device=device, dtype=torch.float32)
        for tile in ROWS_TILES:
            fns = [lambda hb=hb, tile=tile: kern.run_rows(base, (torch.arange(experts, device=device) * block_bytes
                                                                 + (hb.data_ptr() - base.data_ptr())), ids, counts, xe, w, y, tile)
                   for hb in hbanks]
            name = "auto" if tile == (0, 0, 0) else "x".join(map(str, tile))
            try:
                us = time_calls(fns)
                lines.append(f"{shape:6} {T:3d} {distinct:8d} {name:>12} {us:9.1f} {floor:13.1f} {us / floor:8.2f}")
            except Exception as e:  # a config the compiler rejects (registers, shared memory) is skipped
                lines.append(f"{shape:6} {T:3d} {distinct:8d} {name:>12} failed: {type(e).__name__}")
    del hbanks
    return ceil, lines
