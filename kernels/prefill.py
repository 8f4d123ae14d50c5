"""Prefill expert kernel: a grouped GEMM over a whole prompt, rows grouped by expert.

Shape legend: R rows in the launch (the (token, k) pairs routed to its experts), BM/BN/BK tile
sizes, N output features, K input features. `items` [n_items, 3] int32 lists (expert index a,
first row j0, row count) per BM-row tile; rows j of one expert are contiguous; a tile of no rows
reads nothing. Expert a's block is at `bank + offs[a]`.

    out[j, :] = epilogue(x[xrows[j], :] @ W_a^T)      W [N, K] (checkpoint orientation), or
                                                    W [K, N] when KMAJOR (re-laid ReLU^2 down)
    epilogues as in kernels/decode.py: relu2, swiglu (gate and up in one program), weighted
    (y[orows[j]] = round(out) * wts[j]).

FP4 (NVFP4, MXFP4) tiles are used without interleaving nibbles: the dot product is split into the even
elements (low nibbles) and the odd ones (high nibbles), each against the matching columns of x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.decode import EPILOGUES, PLAIN, SWIGLU, TL_DTYPES, WEIGHTED, _act, _biased, _glu
from sluice.kernels.dequant import (DENSE, E2M1_UNSCALE, FP8_BLOCK, FP8_BLOCK_E8M0, FP8_ROW, MXFP4, NVFP4, SCALE_GROUPS, block_scale, e2m1_scaled,
                                    e2m1_to_f32, group_scale, load_fp4_tile, load_tile, repeat_rows, tensor_scale)
from sluice.kernels.layout import ProjLayout


@triton.jit
def _tile_dot(acc, base, W_OFF, S_OFF, S_STRIDE, xp, xr, mm, n, N, K,
              FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, SG: tl.constexpr, KMAJOR: tl.constexpr,
              DOT_DT: tl.constexpr, IEEE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] += x[xr, :] @ W[n, :]^T over all of K (per-tensor scales excluded)."""
    nm = n < N
    if FMT == NVFP4 or FMT == MXFP4:
        KB = K // 2
        for k0 in range(0, KB, BK // 2):
            kb = k0 + tl.arange(0, BK // 2)
            km = kb < KB
            xe = tl.load(xp + xr[:, None] + 2 * kb[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(DOT_DT)
            xo = tl.load(xp + xr[:, None] + 2 * kb[None, :] + 1, mask=mm[:, None] & km[None, :], other=0.0).to(DOT_DT)
            if KMAJOR:  # bytes [K/2, N]; scales [K/SG, N]
                b = tl.load(base + W_OFF + kb[:, None] * N + n[None, :], mask=km[:, None] & nm[None, :], other=0).to(tl.int32)
                HG: tl.constexpr = SG // 2  # bytes per scale group
                if (BK // 2) % HG == 0:  # whole groups: each group's scales load once
                    G: tl.constexpr = BK // 2 // HG
                    g = k0 // HG + tl.arange(0, G)
                    sg = group_scale(base + S_OFF, g[:, None] * S_STRIDE + n[None, :], (g < KB // HG)[:, None] & nm[None, :], FMT)
                    s = repeat_rows(sg * E2M1_UNSCALE, G, HG, BN)
                    lo = e2m1_scaled(b & 15) * s
                    hi = e2m1_scaled(b >> 4) * s
                else:
                    s = group_scale(base + S_OFF, (kb[:, None] // HG) * S_STRIDE + n[None, :], km[:, None] & nm[None, :], FMT)
                    lo = e2m1_to_f32(b & 15) * s
                    hi = e2m1_to_f32(b >> 4) * s
            else:
                lo_t, hi_t = load_fp4_tile(base, W_OFF, S_OFF, S_STRIDE, n, k0, N, KB, FMT, SG, BN, BK // 2)
                lo = tl.trans(lo_t)
                hi = tl.trans(hi_t)
            if IEEE:
                acc += tl.dot(xe, lo.to(DOT_DT), input_precision="ieee")
                acc += tl.dot(xo, hi.to(DOT_DT), input_precision="ieee")
            else:
                acc += tl.dot(xe, lo.to(DOT_DT))
                acc += tl.dot(xo, hi.to(DOT_DT))
    else:
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            xt = tl.load(xp + xr[:, None] + k[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(DOT_DT)
            if KMAJOR:  # W [K, N]
                m2 = km[:, None] & nm[None, :]
                if FMT == DENSE:
                    wt = tl.load((base + W_OFF).to(tl.pointer_type(WDT)) + k[:, None] * N + n[None, :], mask=m2, other=0.0).to(tl.float32)
                else:
                    wt = tl.load((base + W_OFF).to(tl.pointer_type(tl.float8e4nv)) + k[:, None] * N + n[None, :], mask=m2, other=0.0).to(tl.float32)
                    if FMT == FP8_BLOCK or FMT == FP8_BLOCK_E8M0:
                        wt = wt * block_scale(base + S_OFF, (k[:, None] // BLOCK) * S_STRIDE + n[None, :] // BLOCK, m2, FMT)
            else:
                wt = tl.trans(load_tile(base, W_OFF, S_OFF, S_STRIDE, n, k, N, K, FMT, WDT, BLOCK))
            if IEEE:
                acc += tl.dot(xt, wt.to(DOT_DT), input_precision="ieee")
            else:
                acc += tl.dot(xt, wt.to(DOT_DT))
    return acc


# offs and orows are often slices of one layer's tensors (stages/direct.py), 16-byte aligned or not by where the slice
# starts: specialising on that compiles each kernel again at the first odd start, inside a prompt
@triton.jit(do_not_specialize_on_alignment=["offs", "orows", "items"])  # items: a planned group's slice (kernels/experts.py)
def _grouped_gemm_kernel(
    bank, offs, x, X_STRIDE, xrows, out, OUT_STRIDE, orows, wts, items, N, K,
    W_OFF, S_OFF, S2_OFF, S_STRIDE, B_OFF, G_W_OFF, G_S_OFF, G_S2_OFF, G_B_OFF,
    FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr, SG: tl.constexpr, KMAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr, BDT: tl.constexpr, EPI: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    X_DT: tl.constexpr, DOT_DT: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    it = tl.program_id(0)
    a = tl.load(items + it * 3)
    j0 = tl.load(items + it * 3 + 1)
    cnt = tl.load(items + it * 3 + 2)
    if cnt == 0:  # a tile without rows (a batch's expert that no row chose) reads no weights
        return
    j = j0 + tl.arange(0, BM)
    mm = tl.arange(0, BM) < cnt
    xr = tl.load(xrows + j, mask=mm, other=0).to(tl.int64) * X_STRIDE
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    base = bank + tl.multiple_of(tl.load(offs + a), 16)  # blocks start 4 KiB-aligned in every bank
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc = _tile_dot(acc, base, W_OFF, S_OFF, S_STRIDE, x, xr, mm, n, N, K, FMT, WDT, BLOCK, SG, KMAJOR, DOT_DT, IEEE, BN, BK)
    if FMT == FP8_ROW:
        if KMAJOR:  # row-major tiles applied the per-row scale already
            acc = acc * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + n, mask=nm, other=0.0)[None, :]
    acc = acc * tensor_scale(base, S_OFF, S2_OFF, FMT, S2_INV)
    acc = _biased(acc.to(X_DT).to(tl.float32), base, B_OFF, n[None, :], N, HAS_BIAS, BDT, X_DT)
    omask = mm[:, None] & nm[None, :]
    if EPI == WEIGHTED:
        orow = tl.load(orows + j, mask=mm, other=0).to(tl.int64)
        w = tl.load(wts + j, mask=mm, other=0.0).to(tl.float32)
        tl.store(out + orow[:, None] * OUT_STRIDE + n[None, :], (acc * w[:, None]).to(out.dtype.element_ty), mask=omask)
    else:
        if EPI == SWIGLU:
            g = tl.zeros([BM, BN], dtype=tl.float32)
            g = _tile_dot(g, base, G_W_OFF, G_S_OFF, S_STRIDE, x, xr, mm, n, N, K, FMT, WDT, BLOCK, SG, KMAJOR, DOT_DT, IEEE, BN, BK)
            g = g * tensor_scale(base, G_S_OFF, G_S2_OFF, FMT, S2_INV)
            g = _biased(g.to(X_DT).to(tl.float32), base, G_B_OFF, n[None, :], N, HAS_BIAS, BDT, X_DT)
            h = _glu(g, acc, ACT, X_DT, ALPHA, LIMIT)
        elif EPI == PLAIN:
            h = acc
        else:
            h = _act(acc, ACT)
        tl.store(out + j.to(tl.int64)[:, None] * OUT_STRIDE + n[None, :], h.to(X_DT), mask=omask)


def tile_items(counts: list[int], bm: int) -> list[tuple[int, int, int]]:
    """(expert index, first row, rows) per BM-row tile, for experts with `counts` rows stored back to back."""
    items, start = [], 0
    for a, c in enumerate(counts):
        for t in range(0, c, bm):
            items.append((a, start + t, min(bm, c - t)))
        start += c
    return items


def grouped_gemm(bank: torch.Tensor, offs: torch.Tensor, x: torch.Tensor, xrows: torch.Tensor, items: torch.Tensor,
                 layout: ProjLayout, epilogue: str, x_dtype: torch.dtype, out: torch.Tensor, gate: ProjLayout | None = None,
                 act: int = 0, orows: torch.Tensor | None = None, wts: torch.Tensor | None = None,
                 act_args: tuple[float, float] = (0.0, 0.0), bm: int = 16, bn: int = 0, bk: int = 0, num_warps: int = 0) -> torch.Tensor:
    """Launch over `items` (int32 [n, 3], device) built by `tile_items` with the same bm. bn, bk, num_warps 0: by format,
    FP4 128 x 128 with 8 warps (its tiles' decoding is the cost: wider ones share it across more of the dot), else
    64 x 64 with 4 (the H200 sweeps in BENCHMARKS.md)."""
    fp4 = layout.fmt in SCALE_GROUPS
    bn, bk, num_warps = bn or (128 if fp4 else 64), bk or (128 if fp4 else 64), num_warps or (8 if fp4 else 4)
    g = gate or layout
    dot_dt = x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.float32
    dummy = offs
    grid = (items.shape[0], triton.cdiv(layout.n, bn))
    _grouped_gemm_kernel[grid](
        bank, offs, x, x.stride(0), xrows, out, out.stride(0), orows if orows is not None else dummy,
        wts if wts is not None else dummy, items, layout.n, layout.k,
        layout.w_off, layout.s_off, layout.s2_off, layout.s_stride, layout.b_off, g.w_off, g.s_off, g.s2_off, g.b_off,
        FMT=layout.fmt, WDT=TL_DTYPES[layout.wdt], BLOCK=max(layout.block, 1), S2_INV=layout.s2_inv, SG=layout.sg, KMAJOR=layout.relaid,
        HAS_BIAS=layout.b_off >= 0, BDT=TL_DTYPES[layout.bdt], EPI=EPILOGUES[epilogue], ACT=act, ALPHA=act_args[0],
        LIMIT=act_args[1], X_DT=TL_DTYPES[x_dtype], DOT_DT=TL_DTYPES[dot_dt], IEEE=dot_dt == torch.float32,
        BM=bm, BN=bn, BK=bk, num_warps=num_warps,
    )
    return out
