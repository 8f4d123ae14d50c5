"""A batch of routed experts through the Triton kernels, as the compute stage calls it.

Shape legend: T tokens, K top-k, A experts in the batch, R rows (token, k) they serve, Dx expert
input size, I intermediate size. One-token steps use the matvec kernels (kernels/decode.py),
longer ones the grouped GEMM (kernels/prefill.py); either way each projection is one launch for
the whole batch. Outputs go to each row's own slot of y [T*K, Dx]: nothing is accumulated here.
"""

from __future__ import annotations

import torch

from sluice.kernels.decode import down_relaid, matvec
from sluice.kernels.layout import proj_layouts
from sluice.kernels.prefill import grouped_gemm, tile_items

ACTS = {"relu2": 0, "silu": 1}
BM = 64  # prefill row tile: the H200 sweep's best for FP8 / BF16 at ~32 rows per expert (BENCHMARKS.md)


class TritonExperts:
    def __init__(self, manifest, kind: str, act: str, device: torch.device):
        if act not in ACTS:
            raise NotImplementedError(f"Triton expert kernels support activations {sorted(ACTS)}, not {act!r}")
        self.layouts = proj_layouts(manifest.formats, manifest.slots)
        self.kind = kind
        self.act = ACTS[act]
        self.device = device
        self.live_groups = torch.zeros((), dtype=torch.int64, device=device)  # ReLU^2 groups read by the down kernel
        self.total_groups = 0

    def run(self, bank, offs, down_bank, down_offs, counts: list[int], flat_rows: torch.Tensor, K: int,
            xe: torch.Tensor, w_flat: torch.Tensor, y: torch.Tensor, zero_skip: bool) -> None:
        """Experts a = 0..A-1 (blocks at bank + offs[a], their down at down_bank + down_offs[a]) on their rows.

        counts [A] rows per expert; flat_rows [R] their flat (token * K + k) positions, grouped by expert;
        xe [T, Dx] expert input; w_flat [T*K] routing weights; y [T*K, Dx] output rows."""
        L = self.layouts
        x_dtype = xe.dtype
        wts = w_flat[flat_rows]
        A, R = len(counts), flat_rows.numel()
        h = torch.empty(R, L["up"].n, dtype=x_dtype, device=xe.device)
        if R == A and xe.shape[0] == 1:  # one token: one row per expert
            if self.kind == "relu2":
                matvec(bank, offs, xe[0], L["up"], "relu2", x_dtype, h, act=self.act)
                part, live = down_relaid(down_bank, down_offs, h, L["down"], skip=zero_skip)
                self.live_groups += live.sum()
                self.total_groups += A * (L["down"].k // 16)
                y[flat_rows] = (part.sum(1).to(x_dtype).float() * wts.float()[:, None]).to(y.dtype)
            else:
                matvec(bank, offs, xe[0], L["up"], "swiglu", x_dtype, h, gate=L["gate"], act=self.act)
                matvec(down_bank, down_offs, h, L["down"], "weighted", x_dtype, y, rows=flat_rows, wts=wts)
            return
        bm = BM if max(counts) > 16 else 16  # short prompts: do not pad every expert to 64 rows
        items = torch.tensor(tile_items(counts, bm), dtype=torch.int32).to(xe.device, non_blocking=True)
        xrows = flat_rows // K
        if self.kind == "relu2":
            grouped_gemm(bank, offs, xe, xrows, items, L["up"], "relu2", x_dtype, h, act=self.act, bm=bm)
        else:
            grouped_gemm(bank, offs, xe, xrows, items, L["up"], "swiglu", x_dtype, h, gate=L["gate"], act=self.act, bm=bm)
        hrows = torch.arange(R, device=xe.device)
        grouped_gemm(down_bank, down_offs, h, hrows, items, L["down"], "weighted", x_dtype, y, orows=flat_rows, wts=wts, bm=bm)
