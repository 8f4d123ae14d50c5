"""The ReLU^2 down projection of one-token decode, from re-laid blocks: all of a layer's active experts in one launch.

Shape legend: A active experts in the launch, Dx expert output size, I intermediate size, S splits of the groups.
Blocks live in a bank as in kernels/decode.py (`offs` [A] int64 byte offsets, multiples of 16).

    down_relaid   part[a, s, :] = sum over 16-neuron groups g of split s of h[a, g] @ W_a[g]
                  W [I, Dx] re-laid neuron-major (ReLU^2 down); groups whose 16 activations are all
                  zero are skipped, so their weights are never read (zero-skip); live[a, s] counts the
                  groups read
    h_pairs       h [A, I] -> its f16x2 pairs, each 16-neuron group scaled by a power of two, for the
                  f16x2 path (kernels/f16x2.py); the up projection's relu2 epilogue writes the same
    weigh_parts   part [A, S, Dx] -> y[a] = w[a] * (sum over s of part[a, s]) rounded to the model's dtype,
                  and the live groups counted: the down projection's tail in one launch; or (summed) the sum
                  over a of those in order, a one-token step's routed sum

Reductions are fixed-order (no atomics): split partials are summed by the caller in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.decode import F16X2_DOWN, TL_DTYPES
from sluice.kernels.dequant import (DENSE, E2M1_UNSCALE, FP8_BLOCK, FP8_BLOCK_E8M0, FP8_ROW, MXFP4, NVFP4, FORMAT_CODES, SCALE_GROUPS,
                                    block_scale, e2m1_scaled, group_scale, tensor_scale)
from sluice.kernels.f16x2 import fp4_group_dot_f16x2, fp8_group_dot_f16x2, group_pairs
from sluice.kernels.layout import ProjLayout
from sluice.kernels.rounding import FLOATS, rounded


@triton.jit
def _down_relaid_kernel(
    bank, offs, h, part, Dx, I, GROUPS_PER_SPLIT, NSPLIT, live, HQ, HGINV,
    W_OFF, S_OFF, S2_OFF, S_STRIDE,
    FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr, SG: tl.constexpr, SKIP_BELOW: tl.constexpr,
    HOST: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, F16X2: tl.constexpr, ASM: tl.constexpr,
):
    a = tl.program_id(0)
    sp = tl.program_id(1)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    dm = d < Dx
    if FMT == DENSE or HOST:  # blocks start 4 KiB-aligned in every bank; telling the compiler so speeds up
        base = bank + tl.multiple_of(tl.load(offs + a), 16)  # zero-copy reads but slows FP4/FP8 from HBM (H200)
    else:
        base = bank + tl.load(offs + a)
    hp = h + a * I
    if F16X2:  # NVFP4 / FP8 as int32 words of four outputs' bytes, f16x2 products with h's pairs (`h_pairs`)
        _down_f16x2(base, HQ + a * (I // 2), HGINV + a * (I // 16), part + (a * NSPLIT + sp) * Dx, live + a * NSPLIT + sp, Dx, I,
                    sp * GROUPS_PER_SPLIT, W_OFF, S_OFF, S2_OFF, S_STRIDE, GROUPS_PER_SPLIT, FMT, BLOCK, S2_INV, SG, SKIP_BELOW, BD, ASM)
    else:
        acc = tl.zeros([R, BD], dtype=tl.float32)  # R = rows of one group: 8 FP4 byte rows or 16 neurons
        g0 = sp * GROUPS_PER_SPLIT
        g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, I // 16)
        n_live = 0
        for g in range(g0, g1):
            hg = tl.load(hp + g * 16 + tl.arange(0, 16)).to(tl.float32)
            # a branch, not masked loads: masked-off loads of dead groups still cost most of a load
            if tl.max(tl.abs(hg), axis=0) > SKIP_BELOW:  # -1 reads every group, 0 skips all-zero groups
                n_live += 1
                acc += _down_group(base, hp, g, d, dm, hg, Dx, W_OFF, S_OFF, S_STRIDE, FMT, WDT, BLOCK, SG, R)
        out = tl.sum(acc, axis=0)
        if FMT == NVFP4 or FMT == MXFP4:
            out = out * E2M1_UNSCALE
        if FMT == FP8_ROW:
            out = out * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + d, mask=dm, other=0.0)
        out = out * tensor_scale(base, S_OFF, S2_OFF, FMT, S2_INV)
        tl.store(part + (a * NSPLIT + sp) * Dx + d, out, mask=dm)
        if tl.program_id(2) == 0:
            tl.store(live + a * NSPLIT + sp, n_live)


@triton.jit
def _down_group(base, hp, g, d, dm, hg, Dx, W_OFF, S_OFF, S_STRIDE, FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr,
                SG: tl.constexpr, R: tl.constexpr):
    """One 16-neuron group's terms for outputs d (loads masked by dm) as [R, BD] fp32: R FP4 byte rows (each two
    neurons; e2m1_scaled values times the group scale, E2M1_UNSCALE applied after the sum) or R = 16 neuron rows."""
    if FMT == NVFP4 or FMT == MXFP4:
        r = g * 8 + tl.arange(0, R)  # byte row r holds neurons 2r (low nibble) and 2r+1 (high)
        b = tl.load(base + W_OFF + r[:, None] * Dx + d[None, :], mask=dm[None, :], other=0).to(tl.int32)
        s = group_scale(base + S_OFF, (g * 16 // SG) * S_STRIDE + d, dm, FMT)
        h_lo = tl.load(hp + g * 16 + 2 * tl.arange(0, R)).to(tl.float32)
        h_hi = tl.load(hp + g * 16 + 2 * tl.arange(0, R) + 1).to(tl.float32)
        w = (e2m1_scaled(b & 15) * h_lo[:, None] + e2m1_scaled(b >> 4) * h_hi[:, None]) * s[None, :]
    else:  # (one return at the end: Triton compiles code after a return under a constexpr `if` too)
        i = g * 16 + tl.arange(0, R)
        if FMT == DENSE:
            w = tl.load((base + W_OFF).to(tl.pointer_type(WDT)) + i[:, None] * Dx + d[None, :], mask=dm[None, :], other=0.0)
        else:
            w = tl.load((base + W_OFF).to(tl.pointer_type(tl.float8e4nv)) + i[:, None] * Dx + d[None, :], mask=dm[None, :], other=0.0)
        w = w.to(tl.float32) * hg[:, None]
        if FMT == FP8_BLOCK or FMT == FP8_BLOCK_E8M0:  # 16 divides BLOCK: one scale row for the group
            w = w * block_scale(base + S_OFF, (g * 16 // BLOCK) * S_STRIDE + d // BLOCK, dm, FMT)[None, :]
    return w


@triton.jit
def _f16x2_group(base, rows, g, c, cm, H0, H1, H2, H3, H4, H5, H6, H7, ginv, DW, S_OFF, S_STRIDE, FMT: tl.constexpr,
                 BLOCK: tl.constexpr, SG: tl.constexpr, BW: tl.constexpr, ASM: tl.constexpr):
    """One 16-neuron group's rows of words c (loads masked by cm: NVFP4's 8 byte rows, FP8's 16 neuron rows) dotted
    with h's pairs H0..H7 ([BW] int32, the same in every lane), times the group's scales (NVFP4 groups, FP8 blocks)
    and ginv (the pairs' unscale): [BW, 4] fp32. A per-tensor or per-output FP8 scale is the caller's."""
    if FMT == NVFP4:
        r = rows + g * 8 * DW
        d0, d1, d2, d3 = fp4_group_dot_f16x2(
            tl.load(r, mask=cm, other=0), tl.load(r + DW, mask=cm, other=0), tl.load(r + 2 * DW, mask=cm, other=0),
            tl.load(r + 3 * DW, mask=cm, other=0), tl.load(r + 4 * DW, mask=cm, other=0), tl.load(r + 5 * DW, mask=cm, other=0),
            tl.load(r + 6 * DW, mask=cm, other=0), tl.load(r + 7 * DW, mask=cm, other=0), H0, H1, H2, H3, H4, H5, H6, H7, ASM)
    else:
        r = rows + g * 16 * DW
        d0, d1, d2, d3 = fp8_group_dot_f16x2(
            tl.load(r, mask=cm, other=0), tl.load(r + DW, mask=cm, other=0), tl.load(r + 2 * DW, mask=cm, other=0),
            tl.load(r + 3 * DW, mask=cm, other=0), tl.load(r + 4 * DW, mask=cm, other=0), tl.load(r + 5 * DW, mask=cm, other=0),
            tl.load(r + 6 * DW, mask=cm, other=0), tl.load(r + 7 * DW, mask=cm, other=0), tl.load(r + 8 * DW, mask=cm, other=0),
            tl.load(r + 9 * DW, mask=cm, other=0), tl.load(r + 10 * DW, mask=cm, other=0), tl.load(r + 11 * DW, mask=cm, other=0),
            tl.load(r + 12 * DW, mask=cm, other=0), tl.load(r + 13 * DW, mask=cm, other=0), tl.load(r + 14 * DW, mask=cm, other=0),
            tl.load(r + 15 * DW, mask=cm, other=0), H0, H1, H2, H3, H4, H5, H6, H7, ASM)
    dots = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), [BW, 4])  # [w, j]: output 4w + j
    d = 4 * c[:, None] + tl.arange(0, 4)[None, :]
    if FMT == NVFP4:
        dots = dots * group_scale(base + S_OFF, (g * 16 // SG) * S_STRIDE + d, cm[:, None], FMT)
    elif FMT == FP8_BLOCK or FMT == FP8_BLOCK_E8M0:  # 16 divides BLOCK: one scale row for the group
        dots = dots * block_scale(base + S_OFF, (g * 16 // BLOCK) * S_STRIDE + d // BLOCK, cm[:, None], FMT)
    return dots * ginv


@triton.jit
def _down_f16x2(base, hq, hginv, out, live, Dx, I, g0, W_OFF, S_OFF, S2_OFF, S_STRIDE, GPS, FMT: tl.constexpr,
                BLOCK: tl.constexpr, S2_INV: tl.constexpr, SG: tl.constexpr, SKIP_BELOW: tl.constexpr, BD: tl.constexpr,
                ASM: tl.constexpr):
    """_down_relaid_kernel's NVFP4 / FP8 path through f16x2 (f16x2.fp4_group_dot_f16x2, fp8_group_dot_f16x2): a
    program's BD outputs as BD / 4 int32 words per row; each 16-neuron group's rows in one call with its 8 h pairs (hq,
    each group scaled: its unscale in hginv), its four sums per word scaled in fp32. A group is live when one of its
    pairs is not zero (a live group's largest |h| scales to a normal fp16, so no live group reads as zero)."""
    BW: tl.constexpr = BD // 4
    DW = Dx // 4  # words per row
    c = tl.program_id(2) * BW + tl.arange(0, BW)
    cm = c < DW
    rows = (base + W_OFF).to(tl.pointer_type(tl.int32)) + c
    zero = tl.zeros([BW], dtype=tl.int32)
    acc = tl.zeros([BW, 4], dtype=tl.float32)
    g1 = tl.minimum(g0 + GPS, I // 16)
    n_live = 0
    for g in range(g0, g1):
        q = hq + g * 8
        H0, H1, H2, H3 = tl.load(q), tl.load(q + 1), tl.load(q + 2), tl.load(q + 3)
        H4, H5, H6, H7 = tl.load(q + 4), tl.load(q + 5), tl.load(q + 6), tl.load(q + 7)
        if SKIP_BELOW < 0:  # -1 reads every group
            on = True
        else:  # 0 skips all-zero groups (sign bits dropped: -0.0 is zero, as in the fp32 path)
            on = ((H0 | H1 | H2 | H3 | H4 | H5 | H6 | H7) & 0x7FFF7FFF) != 0
        if on:
            n_live += 1
            acc += _f16x2_group(base, rows, g, c, cm, zero + H0, zero + H1, zero + H2, zero + H3, zero + H4, zero + H5,
                                zero + H6, zero + H7, tl.load(hginv + g), DW, S_OFF, S_STRIDE, FMT, BLOCK, SG, BW, ASM)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    o = tl.reshape(acc, [BD]) * tensor_scale(base, S_OFF, S2_OFF, FMT, S2_INV)
    if FMT == FP8_ROW:
        o = o * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + d, mask=d < Dx, other=0.0)
    tl.store(out + d, o, mask=d < Dx)
    if tl.program_id(2) == 0:
        tl.store(live, n_live)


@triton.jit
def _h_pairs_kernel(h, hq, hginv, I, BM: tl.constexpr, FP8: tl.constexpr):
    """Row r of h [R, I] -> hq[r] int32 [I/2] (pair p = h[2p], h[2p+1] as f16x2) and hginv[r] fp32 [I/16], each
    16-value group scaled by its own power of two (`f16x2.group_pairs`). Grid (R, cdiv(I, BM))."""
    r = tl.program_id(0)
    i = tl.program_id(1) * BM + tl.arange(0, BM)
    q, inv = group_pairs(tl.load(h + r * I + i, mask=i < I, other=0.0).to(tl.float32), BM, FP8)
    p = tl.program_id(1) * (BM // 2) + tl.arange(0, BM // 2)
    tl.store(hq + r * (I // 2) + p, q, mask=p < I // 2)
    gi = tl.program_id(1) * (BM // 16) + tl.arange(0, BM // 16)
    tl.store(hginv + r * (I // 16) + gi, inv, mask=gi < I // 16)


def h_pairs(h: torch.Tensor, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, I] (I a multiple of 16) -> (int32 [R, I/2] f16x2 pairs (h[2p], h[2p+1]), fp32 [R, I/16] unscales), each
    16-value group scaled by its own power of two (for NVFP4 weights, or FP8 ones: `f16x2.group_pairs`): down_relaid's
    f16x2 input. matvec's relu2 epilogue writes the same (its `pairs`), so decode does not launch this."""
    R, I = h.shape
    hq = torch.empty(R, I // 2, dtype=torch.int32, device=h.device)
    hginv = torch.empty(R, I // 16, dtype=torch.float32, device=h.device)
    _h_pairs_kernel[(R, triton.cdiv(I, 256))](h, hq, hginv, I, BM=256, FP8=fp8)
    return hq, hginv


def down_relaid(bank: torch.Tensor, offs: torch.Tensor, h: torch.Tensor, layout: ProjLayout, skip: bool,
                splits: int = 0, bd: int = 512, num_warps: int = 4, host: bool | None = None,
                f16x2: bool = False, pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLU^2 down for A experts from re-laid blocks: h [A, I] -> (partials [A, S, Dx] fp32, live groups [A, S] int32).
    host: some blocks are read from host memory (zero-copy), so tell the compiler that rows start 16-byte aligned:
    wide loads, which zero-copy reads need and which made FP4 / FP8 rows read from HBM alone slower (BENCHMARKS.md);
    None: whether the bank is host memory. f16x2 (NVFP4 and FP8; other formats ignore it): h packed into f16x2 pairs
    first (`h_pairs`, one more launch), each group's rows read as int32 words of four outputs and multiplied in f16x2
    (sm_89+ PTX; Triton fp16 elsewhere); pairs: h already packed so (matvec's relu2 epilogue), no launch.

    Default split of the groups: 32 for NVFP4, 16 otherwise (from the H200 sweep in BENCHMARKS.md)."""
    A, I = h.shape
    Dx = layout.n
    assert layout.relaid and I == layout.k and I % max(16, layout.sg if layout.fmt in SCALE_GROUPS else 16) == 0, (layout, h.shape)
    assert layout.b_off < 0, "re-laid down projections with a bias are not supported"
    groups = I // 16
    splits = splits or max(1, min(groups, 32 if layout.fmt in SCALE_GROUPS else 16))
    gps = triton.cdiv(groups, splits)
    splits = triton.cdiv(groups, gps)
    part = torch.empty(A, splits, Dx, dtype=torch.float32, device=h.device)
    live = torch.empty(A, splits, dtype=torch.int32, device=h.device)
    bd = min(bd, triton.next_power_of_2(Dx))
    f16x2 = f16x2 and layout.fmt in F16X2_DOWN
    assert not f16x2 or Dx % 4 == 0, Dx
    fp8 = layout.fmt != FORMAT_CODES["nvfp4"]
    hq, hginv = (pairs if pairs is not None else h_pairs(h, fp8)) if f16x2 else (live, live)
    _down_relaid_kernel[(A, splits, triton.cdiv(Dx, bd))](
        bank, offs, h, part, Dx, I, gps, splits, live, hq, hginv, layout.w_off, layout.s_off, layout.s2_off, layout.s_stride,
        FMT=layout.fmt, WDT=TL_DTYPES[layout.wdt], BLOCK=max(layout.block, 1), S2_INV=layout.s2_inv, SG=layout.sg,
        SKIP_BELOW=0.0 if skip else -1.0, HOST=bank.device.type == "cpu" if host is None else host,
        R=8 if layout.fmt in SCALE_GROUPS else 16, BD=bd, F16X2=f16x2, ASM=f16x2 and h.is_cuda, num_warps=num_warps,
    )
    return part, live


@triton.jit
def _weigh_parts_kernel(part, w, y, live, live_total, Dx, A, S: tl.constexpr, XDT: tl.constexpr, YDT: tl.constexpr,
                        SUM: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr):
    """Grid (cdiv(Dx, BD),): outputs d of every expert a: v[a, d] = w[a] * x_dtype(part[a, 0, d] + ... + part[a, S-1, d])
    (summed in that order) in y_dtype, stored as y[a, d] or (SUM) summed over a = 0..A-1 in that order into y[0, d] in
    x_dtype; program 0 adds live's A * S counts to live_total."""
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    dm = d < Dx
    total = tl.zeros([BD], dtype=tl.float32)
    for a in range(A):
        acc = tl.load(part + a * S * Dx + d, mask=dm, other=0.0)
        for s in tl.static_range(1, S):  # unrolled: an expert's loads issued ahead of the adds that wait for them
            acc += tl.load(part + (a * S + s) * Dx + d, mask=dm, other=0.0)
        v = rounded(rounded(acc, XDT) * tl.load(w + a).to(tl.float32), YDT)
        if SUM:
            total += v  # in fp32, as `ordered_sum` adds
        else:
            tl.store(y + a * Dx + d, v.to(YDT), mask=dm)
    if SUM:
        tl.store(y + d, rounded(total, XDT).to(XDT), mask=dm)
    if tl.program_id(0) == 0:
        n = tl.zeros([], dtype=tl.int64)
        for i in range(0, A * S, BL):
            j = i + tl.arange(0, BL)
            n += tl.sum(tl.load(live + j, mask=j < A * S, other=0).to(tl.int64), axis=0)
        tl.store(live_total, tl.load(live_total) + n)


def weigh_parts(part: torch.Tensor, w: torch.Tensor, live: torch.Tensor, live_total: torch.Tensor, x_dtype: torch.dtype,
                y_dtype: torch.dtype, summed: bool = False, bd: int = 32) -> torch.Tensor:
    """down_relaid's partials part [A, S, Dx] fp32 -> y [A, Dx] y_dtype: each expert's split sums added in order s = 0..S-1,
    rounded to x_dtype (the model's), times its routing weight w [A] in fp32; live [A, S]'s counts added to live_total
    (a 0-d int64). summed: those rows' `ordered_sum` instead, [1, Dx] in x_dtype (a one-token step's routed sum). One
    launch for what is otherwise five or seven (`weigh_parts_ref`)."""
    A, S, Dx = part.shape
    y = torch.empty(1 if summed else A, Dx, dtype=x_dtype if summed else y_dtype, device=part.device)
    # no fused multiply-adds: the weighted rows are rounded, then added, as `weigh_parts_ref` does
    _weigh_parts_kernel[(triton.cdiv(Dx, bd),)](part, w, y, live, live_total, Dx, A, S=S, XDT=TL_DTYPES[x_dtype],
                                                 YDT=TL_DTYPES[y_dtype], SUM=summed, BD=bd, BL=64, num_warps=max(1, bd // 128),
                                                 enable_fp_fusion=False)
    return y


def weigh_parts_ref(part: torch.Tensor, w: torch.Tensor, live: torch.Tensor, live_total: torch.Tensor, x_dtype: torch.dtype,
                    y_dtype: torch.dtype, summed: bool = False) -> torch.Tensor:
    """`weigh_parts` in plain torch, the splits summed in the same order."""
    acc = part[:, 0].clone()
    for s in range(1, part.shape[1]):
        acc += part[:, s]
    live_total += live.sum()
    y = (acc.to(x_dtype).float() * w.float()[:, None]).to(y_dtype)
    return ordered_sum(y[None], x_dtype) if summed else y


@triton.jit
def _ordered_sum_kernel(y, out, D, Y_T, Y_K, Y_D, K: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    m = d < D
    acc = tl.load(y + t * Y_T + d * Y_D, mask=m, other=0.0).to(tl.float32)
    for k in tl.static_range(1, K):
        acc += tl.load(y + t * Y_T + k * Y_K + d * Y_D, mask=m, other=0.0).to(tl.float32)
    tl.store(out + t * D + d, rounded(acc, DT).to(DT), mask=m)


def ordered_sum(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T, K, D] -> [T, D] in dtype: each row's K terms added in order k = 0..K-1 in fp32 (a fixed order whatever
    the device: torch's own sum over k is free to pair them otherwise), then rounded once. On a GPU in one launch
    (`ordered_sum_kernel`: the same adds, bit for bit) for the K + 2 of `ordered_sum_ref`."""
    if y.is_cuda and y.dtype in FLOATS and dtype in FLOATS:
        return ordered_sum_kernel(y, dtype)
    return ordered_sum_ref(y, dtype)


def ordered_sum_kernel(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T, K, D = y.shape
    out = torch.empty(T, D, dtype=dtype, device=y.device)
    bd = min(1024, triton.next_power_of_2(D))
    _ordered_sum_kernel[(T, triton.cdiv(D, bd))](y, out, D, y.stride(0), y.stride(1), y.stride(2), K=K, BD=bd,
                                                 DT=TL_DTYPES[dtype], num_warps=max(1, bd // 256))
    return out


def ordered_sum_ref(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    acc = y[:, 0].to(torch.float32, copy=True)
    for k in range(1, y.shape[1]):
        acc += y[:, k]
    return acc.to(dtype)
