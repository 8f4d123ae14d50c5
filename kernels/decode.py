"""Decode expert kernels: one token, all of a layer's active experts in one launch per projection.

Shape legend: A active experts in the launch, Dx expert input size, I intermediate size.
Every expert's block lives in a bank (one uint8 tensor: the VRAM slot bank, or the host arena);
`offs` [A] int64 gives each block's byte offset in its bank: a multiple of 16 (blocks are 4 KiB-aligned).

    matvec        out[a, n] = epilogue(W_a[n, :] . v_a)    W [N, K] in the checkpoint's orientation
                  epilogues: relu2 (ReLU^2 up), swiglu (act(gate) * up, both projections in one
                  program; gpt-oss's clamped GLU when ACT is GPT_OSS), weighted (y[rows[a]] =
                  round(out) * w[a], for SwiGLU down), plain (out[a] = round(out): quantised
                  resident linears). A projection's bias, when it has one, is added to its
                  rounded output and the sum rounded again, as `x @ W + b` does in torch.
    x_pairs       v [A, K] -> its f16x2 pairs, for the f16x2 matvecs
The ReLU^2 down from re-laid blocks is in kernels/down.py.

Reductions are fixed-order (no atomics): split partials are summed by the caller in order.
`*_ref` functions give the same results in plain torch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sluice.kernels.dequant import (DENSE, E2M1_UNSCALE, FP4_WORD_UNSCALE, FP4_X_SCALE, FP8_BLOCK, FP8_BLOCK_E8M0, FP8_ROW, MXFP4, NVFP4, FORMAT_CODES,
                                    SCALE_GROUPS, block_scale, e2m1_scaled, fp4_word_dot, group_scale, load_bias, tensor_scale)
from sluice.kernels.f16x2 import (f16x2_bits, fp4_pair_dot_f16x2, fp8_word_dot_f16x2, group_pairs,
                                  row_pair_scales, x_pair)
from sluice.kernels.layout import ProjLayout

RELU2 = tl.constexpr(0)
SWIGLU = tl.constexpr(1)
WEIGHTED = tl.constexpr(2)
PLAIN = tl.constexpr(3)
EPILOGUES = {"relu2": 0, "swiglu": 1, "weighted": 2, "plain": 3}
FP4_WORDS = 2  # matvec's FP4 formulation (see matvec)
FP8_FORMATS = {FORMAT_CODES[f] for f in ("fp8", "fp8_row", "fp8_block", "fp8_block_e8m0")}
F16X2_DOWN = FP8_FORMATS | {FORMAT_CODES["nvfp4"]}  # down_relaid's f16x2 path
GPT_OSS = tl.constexpr(2)
SILU_CLAMPED = tl.constexpr(3)
ACTS = {"relu2": 0, "silu": 1, "gpt_oss_glu": 2, "silu_clamped": 3}  # activation name (MoEBlock.act_name) -> ACT code
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
             torch.uint8: tl.uint8, torch.int8: tl.int8, torch.float8_e4m3fn: tl.float8e4nv}


@triton.jit
def _xw(vp, w, wm, I: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    """Element I of each word column's eight inputs, scaled for fp4_word_dot, as [BN, BW]."""
    xi = tl.load(vp + w * 8 + I, mask=wm, other=0.0).to(tl.float32) * FP4_X_SCALE
    return tl.broadcast_to(xi[None, :], [BN, BW])


@triton.jit
def _load(p, mask, EVEN: tl.constexpr):
    """tl.load(p) where every element is in bounds (EVEN), else masked with 0 outside."""
    if EVEN:
        return tl.load(p)
    return tl.load(p, mask=mask, other=0)


@triton.jit
def _row_dots(base, W_OFF, S_OFF, S2_OFF, S_STRIDE, vp, n, N, K,
              FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr, SG: tl.constexpr,
              WORDS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, xq, xinv, ASM: tl.constexpr,
              AHEAD: tl.constexpr, EVEN: tl.constexpr, RA: tl.constexpr = 1):
    """W[n, :] . v for rows n [BN]; fp32. Products accumulate in registers; one reduction at the end.
    WORDS 3 (NVFP4): v's pairs xq (int32 [4, K/8], `x_pairs`) and their unscale xinv instead of v; AHEAD: each
    step's words are requested before the previous step's arithmetic; EVEN (NVFP4 there): whole tiles only; RA (words
    3): a power of two dividing a row's words (NVFP4's int64 groups, FP8's int32 words), so that loads go wide."""
    nm = n < N
    if FMT == NVFP4 and WORDS == 3:
        # a scale group's two words of 8 nibbles as one int64, through the e4m3 conversion and f16x2 FMAs
        # (f16x2.fp4_pair_dot_f16x2), the group scales applied in fp32; EVEN: no bounds to test
        BG: tl.constexpr = BK // 16
        NG = tl.multiple_of(K // 16, RA)
        acc = tl.zeros([BN, BG], dtype=tl.float32)
        rows = (base + W_OFF).to(tl.pointer_type(tl.int64)) + n[:, None] * NG
        xg = xq.to(tl.pointer_type(tl.int64))  # plane J of x's pairs: a group's two words' pairs J in one int64
        gi = tl.arange(0, BG)
        pair = _load(rows + gi[None, :], nm[:, None] & (gi < NG)[None, :], EVEN)
        for g0 in range(0, NG, BG):
            g = g0 + gi
            gm = g < NG
            # the next step's words; after the last step the row's first again (in bounds, so EVEN tests none)
            gn = tl.where(g0 + BG < NG, g0 + BG, 0) + gi
            if AHEAD:  # requested before this step's arithmetic
                nxt = _load(rows + gn[None, :], nm[:, None] & (gn < NG)[None, :], EVEN)
            x0 = _load(xg + g, gm, EVEN)[None, :]
            x1 = _load(xg + NG + g, gm, EVEN)[None, :]
            x2 = _load(xg + 2 * NG + g, gm, EVEN)[None, :]
            x3 = _load(xg + 3 * NG + g, gm, EVEN)[None, :]
            t = fp4_pair_dot_f16x2(pair.to(tl.int32), (pair >> 32).to(tl.int32), x0.to(tl.int32), x1.to(tl.int32),
                                   x2.to(tl.int32), x3.to(tl.int32), (x0 >> 32).to(tl.int32), (x1 >> 32).to(tl.int32),
                                   (x2 >> 32).to(tl.int32), (x3 >> 32).to(tl.int32), ASM)
            acc += t * group_scale(base + S_OFF, n[:, None] * S_STRIDE + g[None, :], nm[:, None] & gm[None, :], FMT, EVEN)
            if not AHEAD:
                nxt = _load(rows + gn[None, :], nm[:, None] & (gn < NG)[None, :], EVEN)
            pair = nxt
        r = tl.sum(acc, axis=1) * tl.load(xinv)
    elif WORDS == 3 and FMT != DENSE and FMT != MXFP4:
        # FP8 as int32 words of four inputs through the e4m3 conversion and f16x2 FMAs (f16x2.fp8_word_dot_f16x2)
        BW: tl.constexpr = BK // 4
        NW = tl.multiple_of(K // 4, RA)
        acc = tl.zeros([BN, BW], dtype=tl.float32)
        rows = (base + W_OFF).to(tl.pointer_type(tl.int32)) + n[:, None] * NW
        for w0 in range(0, NW, BW):
            w = w0 + tl.arange(0, BW)
            wm = w < NW
            word = tl.load(rows + w[None, :], mask=nm[:, None] & wm[None, :], other=0)
            t = fp8_word_dot_f16x2(word, tl.load(xq + w, mask=wm, other=0)[None, :], tl.load(xq + NW + w, mask=wm, other=0)[None, :], ASM)
            if FMT == FP8_BLOCK or FMT == FP8_BLOCK_E8M0:  # BK divides BLOCK: one scale per row in this step
                t = t * block_scale(base + S_OFF, (n // BLOCK) * S_STRIDE + (4 * w0) // BLOCK, nm, FMT)[:, None]
            acc += t
        r = tl.sum(acc, axis=1) * tl.load(xinv)
        if FMT == FP8_ROW:
            r = r * tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + n, mask=nm, other=0.0)
    elif (FMT == NVFP4 or FMT == MXFP4) and WORDS > 0:
        # 32-bit words of 8 nibbles: word w of a row holds elements 8w..8w+7 (nibble i = element 8w+i);
        # fp4_word_dot places each nibble's bits straight into an fp32 (no conversion instruction).
        # WORDS 1: each word gathers its group's scale; 2: a row's scales load as one contiguous run
        BW: tl.constexpr = BK // 8
        NW = K // 8
        wi = tl.arange(0, BW)
        acc = tl.zeros([BN, BW], dtype=tl.float32)
        rows = (base + W_OFF).to(tl.pointer_type(tl.int32)) + n[:, None] * NW
        for w0 in range(0, NW, BW):
            w = w0 + wi
            wm = w < NW
            m2 = nm[:, None] & wm[None, :]
            word = tl.load(rows + w[None, :], mask=m2, other=0)
            t = fp4_word_dot(word, _xw(vp, w, wm, 0, BN, BW), _xw(vp, w, wm, 1, BN, BW), _xw(vp, w, wm, 2, BN, BW),
                             _xw(vp, w, wm, 3, BN, BW), _xw(vp, w, wm, 4, BN, BW), _xw(vp, w, wm, 5, BN, BW),
                             _xw(vp, w, wm, 6, BN, BW), _xw(vp, w, wm, 7, BN, BW))
            if WORDS == 2:  # the step's scales as one contiguous run per row, each repeated for its words
                BG: tl.constexpr = BW // (SG // 8)
                g = w0 // (SG // 8) + tl.arange(0, BG)
                s = group_scale(base + S_OFF, n[:, None] * S_STRIDE + g[None, :], nm[:, None] & (g < NW // (SG // 8))[None, :], FMT)
                s = tl.reshape(tl.join(s, s), [BN, 2 * BG])
                if SG == 32:
                    s = tl.reshape(tl.join(s, s), [BN, BW])
            else:  # each word gathers its scale
                s = group_scale(base + S_OFF, n[:, None] * S_STRIDE + w[None, :] // (SG // 8), m2, FMT)
            acc += t * s
        r = tl.sum(acc, axis=1) * FP4_WORD_UNSCALE
    elif FMT == NVFP4 or FMT == MXFP4:
        G: tl.constexpr = BK // SG  # scale groups per step; each is SG/2 bytes and one scale
        NG = K // SG
        gi = tl.arange(0, G)
        bi = tl.arange(0, SG // 2)
        acc = tl.zeros([BN, G], dtype=tl.float32)
        for g0 in range(0, NG, G):
            g = g0 + gi
            gm = g < NG
            b = tl.load(base + W_OFF + n[:, None, None] * (K // 2) + g[None, :, None] * (SG // 2) + bi[None, None, :],
                        mask=nm[:, None, None] & gm[None, :, None], other=0).to(tl.int32)
            xl = tl.load(vp + g[:, None] * SG + 2 * bi[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            xh = tl.load(vp + g[:, None] * SG + 2 * bi[None, :] + 1, mask=gm[:, None], other=0.0).to(tl.float32)
            t = tl.sum(e2m1_scaled(b & 15) * xl[None, :, :] + e2m1_scaled(b >> 4) * xh[None, :, :], axis=2)
            acc += t * group_scale(base + S_OFF, n[:, None] * S_STRIDE + g[None, :], nm[:, None] & gm[None, :], FMT)
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
            if FMT == FP8_BLOCK or FMT == FP8_BLOCK_E8M0:  # BK divides BLOCK: one scale per row in this step
                sb = block_scale(base + S_OFF, (n // BLOCK) * S_STRIDE + k0 // BLOCK, nm, FMT)
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
def _glu(g, u, ACT: tl.constexpr, X_DT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gated unit from rounded gate and up outputs (fp32): act(g) * u; gpt-oss's
    (clamp(u, -L, L) + 1) * min(g, L) * sigmoid(ALPHA * min(g, L)); or DeepSeek-V4's
    silu(min(g, L)) * clamp(u, -L, L)."""
    if ACT == GPT_OSS or ACT == SILU_CLAMPED:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        if ACT == GPT_OSS:
            return (u + 1.0) * (g / (1.0 + tl.exp(-ALPHA * g)))
        return _act(g, 1).to(X_DT).to(tl.float32) * u
    else:
        return _act(g, ACT).to(X_DT).to(tl.float32) * u


@triton.jit
def _biased(acc, base, B_OFF, n, N, HAS_BIAS: tl.constexpr, BDT: tl.constexpr, X_DT: tl.constexpr):
    """acc [.., BN] (fp32, already rounded to X_DT) plus the projection's bias, rounded again."""
    if HAS_BIAS:
        acc = (acc + load_bias(base, B_OFF, n, N, BDT)).to(X_DT).to(tl.float32)
    return acc


@triton.jit
def _matvec_kernel(
    bank, offs, v, V_STRIDE, out, OUT_STRIDE, rows, wts, N, K, XQ, XQ_STRIDE, XINV, XINV_STRIDE,
    W_OFF, S_OFF, S2_OFF, S_STRIDE, B_OFF, G_W_OFF, G_S_OFF, G_S2_OFF, G_B_OFF,
    FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr, S2_INV: tl.constexpr, SG: tl.constexpr,
    HAS_BIAS: tl.constexpr, BDT: tl.constexpr, EPI: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    X_DT: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    AHEAD: tl.constexpr, HQ, HGINV, PAIRS: tl.constexpr, EVEN: tl.constexpr, RA: tl.constexpr,
):
    a = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    base = bank + tl.multiple_of(tl.load(offs + a), 16)  # blocks start 4 KiB-aligned in every bank
    vp = v + a * V_STRIDE
    xq, xinv = XQ + a * XQ_STRIDE, XINV + a * XINV_STRIDE
    acc = _row_dots(base, W_OFF, S_OFF, S2_OFF, S_STRIDE, vp, n, N, K, FMT, WDT, BLOCK, S2_INV, SG, WORDS, BN, BK, xq, xinv, ASM, AHEAD,
                    EVEN, RA)
    acc = acc.to(X_DT).to(tl.float32)  # the reference rounds each linear's output to the activation dtype
    acc = _biased(acc, base, B_OFF, n, N, HAS_BIAS, BDT, X_DT)
    if EPI == WEIGHTED:
        row = tl.load(rows + a)
        w = tl.load(wts + a).to(tl.float32)
        tl.store(out + row * OUT_STRIDE + n, (acc * w).to(out.dtype.element_ty), mask=n < N)
    else:
        if EPI == SWIGLU:
            g = _row_dots(base, G_W_OFF, G_S_OFF, G_S2_OFF, S_STRIDE, vp, n, N, K, FMT, WDT, BLOCK, S2_INV, SG, WORDS, BN, BK,
                          xq, xinv, ASM, AHEAD, EVEN, RA)
            g = _biased(g.to(X_DT).to(tl.float32), base, G_B_OFF, n, N, HAS_BIAS, BDT, X_DT)
            h = _glu(g, acc, ACT, X_DT, ALPHA, LIMIT)
        elif EPI == PLAIN:
            h = acc
        else:
            h = _act(acc, ACT)
        tl.store(out + a * OUT_STRIDE + n, h.to(X_DT), mask=n < N)
        if PAIRS:  # h as down_relaid's f16x2 pairs too, each 16-row group (whole in a tile: BN, N multiples of 16) scaled
            q, inv = group_pairs(h.to(X_DT).to(tl.float32), BN, PAIRS == 2)  # 1: for NVFP4 weights, 2: FP8
            p = tl.program_id(1) * (BN // 2) + tl.arange(0, BN // 2)
            tl.store(HQ + a * (N // 2) + p, q, mask=p < N // 2)
            gi = tl.program_id(1) * (BN // 16) + tl.arange(0, BN // 16)
            tl.store(HGINV + a * (N // 16) + gi, inv, mask=gi < N // 16)


@triton.jit
def _x_pairs_kernel(v, V_STRIDE, xq, xinv, K, NW, BW: tl.constexpr, BM: tl.constexpr, FP8: tl.constexpr):
    """Row r of v [R, K] -> xq[r] int32 [4, NW] (NVFP4 words of 8 inputs; plane J: pair J of every word,
    `f16x2.x_pair`) or [2, NW] (FP8 words of 4: plane J the pair (x[4w + 2J], x[4w + 2J + 1])) and xinv[r]. Grid
    (R, cdiv(NW, BW)): each program finds the row's largest |x| itself (K is a hidden size) and packs BW words."""
    r = tl.program_id(0)
    vp = v + r * V_STRIDE
    scale, inv = row_pair_scales(vp, K, BM, FP8)
    if tl.program_id(1) == 0:
        tl.store(xinv + r, inv)
    w = tl.program_id(1) * BW + tl.arange(0, BW)
    wm = w < NW
    if FP8:
        for J in tl.static_range(2):
            q = f16x2_bits(tl.load(vp + 4 * w + 2 * J, mask=wm, other=0.0), tl.load(vp + 4 * w + 2 * J + 1, mask=wm, other=0.0), scale)
            tl.store(xq + r * 2 * NW + J * NW + w, q, mask=wm)
    else:
        for J in tl.static_range(4):
            tl.store(xq + r * 4 * NW + J * NW + w, x_pair(vp, w, wm, J, scale), mask=wm)


def x_pairs(v: torch.Tensor, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """v [K] or [R, K] -> (int32 [R, 4, K/8] f16x2 pairs, fp32 [R] unscale) for matvec's f16x2 NVFP4 path; with fp8
    (int32 [R, 2, K/4], fp32 [R]) for its FP8 one."""
    v2 = v if v.dim() == 2 else v[None]
    R, K = v2.shape
    planes = 2 if fp8 else 4
    NW = K // 4 if fp8 else K // 8
    xq = torch.empty(R, planes, NW, dtype=torch.int32, device=v.device)
    xinv = torch.empty(R, dtype=torch.float32, device=v.device)
    _x_pairs_kernel[(R, triton.cdiv(NW, 128))](v2, v2.stride(0), xq, xinv, K, NW, BW=128, BM=1024, FP8=fp8)
    return xq, xinv


def matvec(bank: torch.Tensor, offs: torch.Tensor, v: torch.Tensor, layout: ProjLayout, epilogue: str, x_dtype: torch.dtype,
           out: torch.Tensor, gate: ProjLayout | None = None, act: int = 0, rows: torch.Tensor | None = None,
           wts: torch.Tensor | None = None, act_args: tuple[float, float] = (0.0, 0.0), bn: int = 0, bk: int = 0,
           num_warps: int = 4, fp4_words: int = FP4_WORDS, pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
           pairs_fp8: bool = False, ahead: bool | None = None) -> torch.Tensor:
    """Launch `_matvec_kernel` for A = len(offs) experts. v [K] shared or [A, K]; out [A, N] or y [rows, N].
    act_args: (alpha, limit) of gpt-oss's GLU. fp4_words: FP4 weights read as 32-bit words of eight
    nibbles, their scales loaded as contiguous runs (2) or gathered word by word (1); 0: as bytes in
    [rows, groups, bytes] tiles, the earlier formulation. 1 and 0 are kept for the sweep. 3 (NVFP4; MXFP4
    reads it as 2): a scale group's two words read as one int64 and put through the e4m3 conversion and f16x2 FMAs
    (f16x2.fp4_pair_dot_f16x2), v first packed by `x_pairs` (one more launch); faster than 2 on ReLU^2 up
    projections in `sluice bench kernels` (docs/benchmarks/), the default for ReLU^2 on sm_89+
    (stages/compute.py fp4_formulation). Where the tiles cover N and K whole, its loads test no bounds. 3 also takes FP8 weights
    (K a multiple of 4) through f16x2: int32 words of four E4M3 inputs, two conversions and two f16x2 FMAs each,
    x packed in pairs for them (`x_pairs` with fp8); other formats ignore it.

    f16x2 details: ahead: each step's words are requested before the previous step's arithmetic; None: below 2048
    inputs, where requesting ahead did not pay (docs/benchmarks/). NVFP4's last step requests the row's first words again, so whole tiles test no bounds. pairs (relu2
    epilogue): h is also written as `h_pairs` packs it, (int32 [A, N/2], fp32 [A, N/16]), for down_relaid's f16x2
    path (scaled for FP8 weights with pairs_fp8): no packing launch there.

    Tiles (bn rows x bk inputs, 4 warps) were picked by timing on an H200 (`sluice bench kernels`): FP4 words
    32 x 256 (16 x 1024 from 2048 inputs on), f16x2 32 x 256 (16 x 512 from 2048 on; NVFP4 16 x 256 below 2048),
    FP8 8 x 256, dense 16 x 256."""
    A = offs.numel()
    fp8 = layout.fmt in FP8_FORMATS
    words = fp4_words if layout.fmt in SCALE_GROUPS else 3 if fp4_words == 3 and fp8 and layout.k % 4 == 0 else 0
    if words == 3 and layout.fmt == FORMAT_CODES["mxfp4"]:  # the f16x2 FP4 path reads NVFP4's 16-input groups only
        words = 2
    wide = words and layout.k >= 2048
    nvfp4_pairs = words == 3 and layout.fmt == FORMAT_CODES["nvfp4"]
    ahead = not wide if ahead is None else ahead
    bn = bn or (16 if wide or nvfp4_pairs else 32 if words else 16 if layout.fmt == 0 else 8)
    bk = min(bk or ((512 if words == 3 else 1024) if wide else 256), max(16, triton.next_power_of_2(layout.k)))
    if words == 2 and bk < layout.sg:  # a step narrower than a scale group: each word gathers its scale
        words = 1
    if layout.block:  # FP8 blocks: a step must not straddle two scale blocks
        bk = min(bk, layout.block)
        assert layout.block % bk == 0, (layout.block, bk)
    assert not layout.relaid and (gate is None or (gate.fmt, gate.wdt, gate.n, gate.k, gate.b_off >= 0) == (layout.fmt, layout.wdt, layout.n, layout.k, layout.b_off >= 0))
    v_stride = 0 if v.dim() == 1 else v.stride(0)
    g = gate or layout
    dummy = offs
    xq, xinv = x_pairs(v, fp8) if words == 3 else (dummy, dummy)
    if pairs is not None:  # whole 16-row groups in every tile
        assert epilogue == "relu2" and layout.n % 16 == 0, (epilogue, layout.n)
        bn = max(bn, 16)
    hq, hginv = pairs if pairs is not None else (dummy, dummy)
    _matvec_kernel[(A, triton.cdiv(layout.n, bn))](
        bank, offs, v, v_stride, out, out.stride(0), rows if rows is not None else dummy, wts if wts is not None else dummy,
        layout.n, layout.k, xq, xq.stride(0) if v_stride and words == 3 else 0, xinv, 1 if v_stride else 0, layout.w_off, layout.s_off, layout.s2_off, layout.s_stride, layout.b_off, g.w_off, g.s_off, g.s2_off, g.b_off,
        FMT=layout.fmt, WDT=TL_DTYPES[layout.wdt], BLOCK=max(layout.block, 1), S2_INV=layout.s2_inv, SG=layout.sg,
        HAS_BIAS=layout.b_off >= 0, BDT=TL_DTYPES[layout.bdt], EPI=EPILOGUES[epilogue], ACT=act, ALPHA=act_args[0], LIMIT=act_args[1],
        X_DT=TL_DTYPES[x_dtype], WORDS=words, ASM=words == 3 and out.is_cuda, BN=bn, BK=bk, AHEAD=ahead,
        HQ=hq, HGINV=hginv, PAIRS=0 if pairs is None else 2 if pairs_fp8 else 1,
        EVEN=nvfp4_pairs and layout.n % bn == 0 and layout.k % bk == 0,
        RA=math.gcd(layout.k // (16 if nvfp4_pairs else 4), 8) if words == 3 else 1,
        num_warps=num_warps,
    )
    return out
