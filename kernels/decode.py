"""Decode expert kernels: one token, all of a layer's active experts in one launch per projection.

Shape legend: A active experts in the launch, Dx expert input size, I intermediate size.
Every expert's block lives in a bank (one uint8 tensor: the VRAM slot bank, or the host arena);
`offs` [A] int64 gives each block's byte offset in its bank.

    matvec        out[a, n] = epilogue(W_a[n, :] . v_a)    W [N, K] in the checkpoint's orientation
                  epilogues: relu2 (ReLU^2 up), swiglu (act(gate) * up, both projections in one
                  program), weighted (y[rows[a]] = round(out) * w[a], for SwiGLU down),
                  plain (out[a] = round(out): quantised resident linears)
    down_relaid   part[a, s, :] = sum over 16-neuron groups g of split s of h[a, g] @ W_a[g]
                  W [I, Dx] re-laid neuron-major (ReLU^2 down); groups whose 16 activations are all
                  zero are skipped, so their weights are never read (zero-skip)

Reductions are fixed-order (no atomics): split partials are summed by the caller in order.
`*_ref` functions give the same results in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.dequant import DENSE, E2M1_UNSCALE, FP8_BLOCK, FP8_ROW, NVFP4, e2m1_scaled, tensor_scale
from sluice.kernels.layout import ProjLayout

RELU2 = tl.constexpr(0)
SWIGLU = tl.constexpr(1)
WEIGHTED = tl.constexpr(2)
PLAIN = tl.constexpr(3)
EPILOGUES = {"relu2": 0, "swiglu": 1, "weighted": 2, "plain": 3}
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
             torch.uint8: tl.uint8, torch.float8_e4m3fn: tl.float8e4nv}


@triton.jit
def _row_dots(base, W_OFF, S_OFF, S2_OFF, S_STRIDE, vp, n, N, K,
              FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W[n, :] . v for rows n [BN]; fp32. Products accumulate in registers; one reduction at the end."""
    nm = n < N
    if FMT == NVFP4:
        G: tl.constexpr = BK // 16  # 16-element groups per step; each is 8 bytes and one E4M3 scale
        NG = K // 16
        gi = tl.arange(0, G)
        bi = tl.arange(0, 8)
        acc = tl.zeros([BN, G], dtype=tl.float32)
        for g0 in range(0, NG, G):
            g = g0 + gi
            gm = g < NG
            b = tl.load(base + W_OFF + n[:, None, None] * (K // 2) + g[None, :, None] * 8 + bi[None, None, :],
                        mask=nm[:, None, None] & gm[None, :, None], other=0).to(tl.int32)
            xl = tl.load(vp + g[:, None] * 16 + 2 * bi[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            xh = tl.load(vp + g[:, None] * 16 + 2 * bi[None, :] + 1, mask=gm[:, None], other=0.0).to(tl.float32)
            t = tl.sum(e2m1_scaled(b & 15) * xl[None, :, :] + e2m1_scaled(b >> 4) * xh[None, :, :], axis=2)
            s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float8e4nv)) + n[:, None] * S_STRIDE + g[None, :],
                        mask=nm[:, None] & gm[None, :], other=0.0).to(tl.float32)
            acc += t * s
        r = tl.sum(acc, axis=1) * E2M1_UNSCALE
    else:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            m2 = nm[:, None] & km[None, :]
            if FMT == DENSE:
                w = tl.load((base + W_OFF).to(tl.pointer_type(WDT)) + n[:, None] * K + k[None, :], mask=m2, other=0.0).to(tl.float32)
            else:
                w = tl.load((base + W_OFF).to(tl.pointer_type(tl.float8e4nv)) + n[:, None] * K + k[None, :], mask=m2, other=0.0).to(tl.float32)
            x = tl.load(vp + k, mask=km, other=0.0).to(tl.float32)
            if FMT == FP8_BLOCK:  # BK divides BLOCK: one scale per row in this step
                sb = tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + (n // BLOCK) * S_STRIDE + k0 // BLOCK, mask=nm, other=0.0)
                acc += w * x[None, :] * sb[:, None]
            else:
                acc += w * x[None, :]
        r = tl.sum(acc, axis=1)
        if FMT == FP8_ROW:
            r = r * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + n, mask=nm, other=0.0)
    return r * tensor_scale(base, S_OFF, S2_OFF, FMT, S2_INV)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:  # relu2
        r = tl.maximum(x, 0.0)
        return r * r
    else:  # silu
        return x / (1.0 + tl.exp(-x))


@triton.jit
def _matvec_kernel(
    bank, offs, v, V_STRIDE, out, OUT_STRIDE, rows, wts, N, K,
    W_OFF, S_OFF, S2_OFF, S_STRIDE, G_W_OFF, G_S_OFF, G_S2_OFF,
    FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr,
    EPI: tl.constexpr, ACT: tl.constexpr, X_DT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    a = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    base = bank + tl.load(offs + a)
    vp = v + a * V_STRIDE
    acc = _row_dots(base, W_OFF, S_OFF, S2_OFF, S_STRIDE, vp, n, N, K, FMT, WDT, BLOCK, S2_INV, BN, BK)
    if EPI == WEIGHTED:
        row = tl.load(rows + a)
        w = tl.load(wts + a).to(tl.float32)
        y = acc.to(X_DT).to(tl.float32) * w
        tl.store(out + row * OUT_STRIDE + n, y.to(out.dtype.element_ty), mask=n < N)
    else:
        acc = acc.to(X_DT).to(tl.float32)  # the reference rounds each linear's output to the activation dtype
        if EPI == SWIGLU:
            g = _row_dots(base, G_W_OFF, G_S_OFF, G_S2_OFF, S_STRIDE, vp, n, N, K, FMT, WDT, BLOCK, S2_INV, BN, BK)
            h = _act(g.to(X_DT).to(tl.float32), ACT).to(X_DT).to(tl.float32) * acc
        elif EPI == PLAIN:
            h = acc
        else:
            h = _act(acc, ACT)
        tl.store(out + a * OUT_STRIDE + n, h.to(X_DT), mask=n < N)


@triton.jit
def _down_relaid_kernel(
    bank, offs, h, part, Dx, I, GROUPS_PER_SPLIT, NSPLIT, live,
    W_OFF, S_OFF, S2_OFF, S_STRIDE,
    FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr, SKIP_BELOW: tl.constexpr,
    R: tl.constexpr, BD: tl.constexpr,
):
    a = tl.program_id(0)
    sp = tl.program_id(1)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    dm = d < Dx
    base = bank + tl.load(offs + a)
    hp = h + a * I
    acc = tl.zeros([R, BD], dtype=tl.float32)  # R = rows of one group: 8 NVFP4 byte rows or 16 neurons
    g0 = sp * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, I // 16)
    n_live = 0
    for g in range(g0, g1):
        hg = tl.load(hp + g * 16 + tl.arange(0, 16)).to(tl.float32)
        if tl.max(tl.abs(hg), axis=0) > SKIP_BELOW:  # -1 reads every group, 0 skips all-zero groups
            n_live += 1
            if FMT == NVFP4:
                r = g * 8 + tl.arange(0, R)  # byte row r holds neurons 2r (low nibble) and 2r+1 (high)
                b = tl.load(base + W_OFF + r[:, None] * Dx + d[None, :], mask=dm[None, :], other=0).to(tl.int32)
                s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float8e4nv)) + g * S_STRIDE + d, mask=dm, other=0.0).to(tl.float32)
                h_lo = tl.load(hp + g * 16 + 2 * tl.arange(0, R)).to(tl.float32)
                h_hi = tl.load(hp + g * 16 + 2 * tl.arange(0, R) + 1).to(tl.float32)
                acc += (e2m1_scaled(b & 15) * h_lo[:, None] + e2m1_scaled(b >> 4) * h_hi[:, None]) * s[None, :]
            else:
                i = g * 16 + tl.arange(0, R)
                if FMT == DENSE:
                    w = tl.load((base + W_OFF).to(tl.pointer_type(WDT)) + i[:, None] * Dx + d[None, :], mask=dm[None, :], other=0.0)
                else:
                    w = tl.load((base + W_OFF).to(tl.pointer_type(tl.float8e4nv)) + i[:, None] * Dx + d[None, :], mask=dm[None, :], other=0.0)
                w = w.to(tl.float32) * hg[:, None]
                if FMT == FP8_BLOCK:  # 16 divides BLOCK: one scale row for the group
                    w = w * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + (g * 16 // BLOCK) * S_STRIDE + d // BLOCK, mask=dm, other=0.0)[None, :]
                acc += w
    out = tl.sum(acc, axis=0)
    if FMT == NVFP4:
        out = out * E2M1_UNSCALE
    if FMT == FP8_ROW:
        out = out * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + d, mask=dm, other=0.0)
    out = out * tensor_scale(base, S_OFF, S2_OFF, FMT, S2_INV)
    tl.store(part + (a * NSPLIT + sp) * Dx + d, out, mask=dm)
    if tl.program_id(2) == 0:
        tl.store(live + a * NSPLIT + sp, n_live)


def matvec(bank: torch.Tensor, offs: torch.Tensor, v: torch.Tensor, layout: ProjLayout, epilogue: str, x_dtype: torch.dtype,
           out: torch.Tensor, gate: ProjLayout | None = None, act: int = 0, rows: torch.Tensor | None = None,
           wts: torch.Tensor | None = None, bn: int = 0, bk: int = 256, num_warps: int = 4) -> torch.Tensor:
    """Launch `_matvec_kernel` for A = len(offs) experts. v [K] shared or [A, K]; out [A, N] or y [rows, N].

    Tiles (bn rows x bk inputs, 4 warps) were picked by `sluice bench kernels --sweep` on an H200
    (BENCHMARKS.md): 8 rows for NVFP4 / FP8, 16 for dense weights."""
    A = offs.numel()
    bn = bn or (16 if layout.fmt == 0 else 8)
    bk = min(bk, max(16, triton.next_power_of_2(layout.k)))
    if layout.block:  # FP8 blocks: a step must not straddle two scale blocks
        bk = min(bk, layout.block)
        assert layout.block % bk == 0, (layout.block, bk)
    assert not layout.relaid and (gate is None or (gate.fmt, gate.wdt, gate.n, gate.k) == (layout.fmt, layout.wdt, layout.n, layout.k))
    v_stride = 0 if v.dim() == 1 else v.stride(0)
    g = gate or layout
    dummy = offs
    _matvec_kernel[(A, triton.cdiv(layout.n, bn))](
        bank, offs, v, v_stride, out, out.stride(0), rows if rows is not None else dummy, wts if wts is not None else dummy,
        layout.n, layout.k, layout.w_off, layout.s_off, layout.s2_off, layout.s_stride, g.w_off, g.s_off, g.s2_off,
        FMT=layout.fmt, WDT=TL_DTYPES[layout.wdt], BLOCK=max(layout.block, 1), S2_INV=layout.s2_inv,
        EPI=EPILOGUES[epilogue], ACT=act, X_DT=TL_DTYPES[x_dtype], BN=bn, BK=bk, num_warps=num_warps,
    )
    return out


def down_relaid(bank: torch.Tensor, offs: torch.Tensor, h: torch.Tensor, layout: ProjLayout, skip: bool,
                splits: int = 0, bd: int = 512, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLU^2 down for A experts from re-laid blocks: h [A, I] -> (partials [A, S, Dx] fp32, live groups [A, S] int32).

    Default split of the groups: 32 for NVFP4, 16 otherwise (from the H200 sweep in BENCHMARKS.md)."""
    A, I = h.shape
    Dx = layout.n
    assert layout.relaid and I == layout.k and I % 16 == 0, (layout, h.shape)
    groups = I // 16
    splits = splits or max(1, min(groups, 32 if layout.fmt == 4 else 16))
    gps = triton.cdiv(groups, splits)
    splits = triton.cdiv(groups, gps)
    part = torch.empty(A, splits, Dx, dtype=torch.float32, device=h.device)
    live = torch.empty(A, splits, dtype=torch.int32, device=h.device)
    bd = min(bd, triton.next_power_of_2(Dx))
    _down_relaid_kernel[(A, splits, triton.cdiv(Dx, bd))](
        bank, offs, h, part, Dx, I, gps, splits, live, layout.w_off, layout.s_off, layout.s2_off, layout.s_stride,
        FMT=layout.fmt, WDT=TL_DTYPES[layout.wdt], BLOCK=max(layout.block, 1), S2_INV=layout.s2_inv, SKIP_BELOW=0.0 if skip else -1.0,
        R=8 if layout.fmt == 4 else 16, BD=bd, num_warps=num_warps,
    )
    return part, live
