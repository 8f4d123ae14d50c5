"""Triton device functions: decode stored weights to fp32 in registers.

Formats (kernels/formats.py) as constexpr codes. Weights are addressed inside a block buffer:
`base` is the block's first byte, `*_OFF` byte offsets of its tensors. FP4 (NVFP4, MXFP4) nibbles
are decoded in software (the H200 has no FP4 path); E4M3 scales and FP8 weights use Triton's
float8e4nv conversion, E8M0 scales (MXFP4) become fp32 exponent bits. `SG` is an FP4 format's
scale group in elements: 16 for NVFP4, 32 for MXFP4.

Shape legend: BN rows (output features) and BK columns (input features) of a tile, in the
checkpoint's [out, in] orientation unless the tile loader says K-major (re-laid ReLU^2 down).
"""

from __future__ import annotations

import triton
import triton.language as tl

DENSE = tl.constexpr(0)
FP8 = tl.constexpr(1)  # one scale for the tensor
FP8_ROW = tl.constexpr(2)  # one scale per output row
FP8_BLOCK = tl.constexpr(3)  # one scale per BxB tile
NVFP4 = tl.constexpr(4)
MXFP4 = tl.constexpr(5)
FP8_BLOCK_E8M0 = tl.constexpr(6)  # FP8_BLOCK with E8M0 scales (DeepSeek-V4's `.scale`)

FORMAT_CODES = {"dense": 0, "fp8": 1, "fp8_row": 2, "fp8_block": 3, "nvfp4": 4, "mxfp4": 5, "fp8_block_e8m0": 6}
SCALE_GROUPS = {4: 16, 5: 32}  # FP4 format code -> elements per scale


E2M1_UNSCALE = tl.constexpr(16384.0)  # e2m1_scaled returns values / 2**14


@triton.jit
def e2m1_scaled(nib):
    """4-bit E2M1 codes (int32, 0..15) -> fp32 value * 2**-14, in five integer ops.

    E2M1 bits s.ee.m placed at fp16's sign, low exponent and top mantissa bits give an fp16 equal
    to the E2M1 value times 2**-14 (normals and the subnormal 0.5 alike, since both formats'
    biases differ by 14): multiply by E2M1_UNSCALE, or fold it into the group scale."""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


FP4_X_SCALE = tl.constexpr(2.0**64)  # fp4_word_dot's x values are multiplied by this first ...
FP4_WORD_UNSCALE = tl.constexpr(2.0**62)  # ... and its sums by this after (2**126 / 2**64)
_SIGN_MAG = tl.constexpr(-2118123520)  # 0x81C00000 as int32: fp32 sign and bits 22-24


@triton.jit
def _nibble_f32(word, I: tl.constexpr):
    """Nibble I of each 32-bit word as fp32 bits: magnitude at 22-24, sign at 31 = E2M1 value * 2**-126
    (the subnormal 0.5 included, as in e2m1_scaled)."""
    J: tl.constexpr = I % 4
    src = word if I < 4 else word >> 16
    q = src & (15 << (4 * J))
    return (((q << (22 - 4 * J)) | (q << (28 - 4 * J))) & _SIGN_MAG).to(tl.float32, bitcast=True)


@triton.jit
def fp4_word_dot(word, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_i E2M1(nibble i of word) * x_i * 2**-126, elementwise over 32-bit words (int32) of eight
    nibbles. x_i: fp32, scaled by FP4_X_SCALE so that the products stay normal; multiply the sums
    by FP4_WORD_UNSCALE. Per nibble the compiler emits four instructions: an and, one multiply
    that makes both shifted copies, an and, an FMA (no conversion instruction; the same count as
    hand-written PTX, which was tried and dropped: BENCHMARKS.md)."""
    t = _nibble_f32(word, 0) * x0
    t += _nibble_f32(word, 1) * x1
    t += _nibble_f32(word, 2) * x2
    t += _nibble_f32(word, 3) * x3
    t += _nibble_f32(word, 4) * x4
    t += _nibble_f32(word, 5) * x5
    t += _nibble_f32(word, 6) * x6
    t += _nibble_f32(word, 7) * x7
    return t


@triton.jit
def e2m1_to_f32(nib):
    """4-bit E2M1 codes (int32, 0..15) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    return e2m1_scaled(nib) * E2M1_UNSCALE


@triton.jit
def scalar_f32(base, off):
    """An fp32 scalar stored at byte `off` of the block."""
    return tl.load((base + off).to(tl.pointer_type(tl.float32)))


@triton.jit
def load_tile(base, W_OFF, S_OFF, S_STRIDE, n, k, N, K, FMT: tl.constexpr, WDT: tl.constexpr, BLOCK: tl.constexpr):
    """Dense/FP8 weight tile W[n, k] as fp32 (n [BN] rows, k [BK] cols, W [N, K] row-major).

    The per-tensor scale is left to the caller (it factors out of the dot product)."""
    mask = (n[:, None] < N) & (k[None, :] < K)
    if FMT == DENSE:
        w = tl.load((base + W_OFF).to(tl.pointer_type(WDT)) + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load((base + W_OFF).to(tl.pointer_type(tl.float8e4nv)) + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if FMT == FP8_ROW:
            s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + n, mask=n < N, other=0.0)
            w = w * s[:, None]
        if FMT == FP8_BLOCK or FMT == FP8_BLOCK_E8M0:
            w = w * block_scale(base + S_OFF, (n[:, None] // BLOCK) * S_STRIDE + k[None, :] // BLOCK, mask, FMT)
    return w


@triton.jit
def e8m0(sp, idx, mask):
    """E8M0 scale bytes at sp + idx as fp32 2**(e - 127) (e = 0 reads as 0 rather than 2**-127, which no
    weight of any size can tell apart)."""
    e = tl.load(sp + idx, mask=mask, other=0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def block_scale(sp, idx, mask, FMT: tl.constexpr):
    """FP8 block scales (element idx of the scale tensor at byte pointer sp) as fp32: F32 or E8M0."""
    if FMT == FP8_BLOCK_E8M0:
        return e8m0(sp, idx, mask)
    else:
        return tl.load(sp.to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)


@triton.jit
def group_scale(sp, idx, mask, FMT: tl.constexpr, EVEN: tl.constexpr = False):
    """FP4 group scales at byte pointer sp + idx as fp32: E4M3 (NVFP4) or E8M0 (MXFP4). EVEN (NVFP4): every idx in
    bounds, mask unused."""
    if FMT == MXFP4:
        return e8m0(sp, idx, mask)
    elif EVEN:
        return tl.load(sp.to(tl.pointer_type(tl.float8e4nv)) + idx).to(tl.float32)
    else:
        return tl.load(sp.to(tl.pointer_type(tl.float8e4nv)) + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def repeat_cols(s, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """s [R, G] -> [R, G * W]: each column repeated W times (a tile's group scales, one per element)."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], [R, G, W]), [R, G * W])


@triton.jit
def repeat_rows(s, G: tl.constexpr, W: tl.constexpr, C: tl.constexpr):
    """s [G, C] -> [G * W, C]: each row repeated W times."""
    return tl.reshape(tl.broadcast_to(s[:, None, :], [G, W, C]), [G * W, C])


@triton.jit
def load_fp4_tile(base, W_OFF, S_OFF, S_STRIDE, n, k0, N, KB, FMT: tl.constexpr, SG: tl.constexpr, BN: tl.constexpr,
                  BKB: tl.constexpr):
    """FP4 tile: bytes W[n, k0 : k0 + BKB] (byte j holds elements 2j (low) and 2j+1 (high)); n [BN] rows.

    Returns (lo, hi) fp32 [BN, BKB], each scaled by its group's scale (group = j // (SG / 2)). Where the tile holds
    whole groups, their scales load once per group (not once per byte) and E2M1_UNSCALE goes into them.
    NVFP4's second-level scale is left to the caller."""
    kb = k0 + tl.arange(0, BKB)
    mask = (n[:, None] < N) & (kb[None, :] < KB)
    b = tl.load((base + W_OFF) + n[:, None] * KB + kb[None, :], mask=mask, other=0).to(tl.int32)
    HG: tl.constexpr = SG // 2  # bytes per scale group
    if BKB % HG == 0:
        G: tl.constexpr = BKB // HG
        g = k0 // HG + tl.arange(0, G)
        sg = group_scale(base + S_OFF, n[:, None] * S_STRIDE + g[None, :], (n[:, None] < N) & (g[None, :] < KB // HG), FMT)
        s = repeat_cols(sg * E2M1_UNSCALE, BN, G, HG)
        return e2m1_scaled(b & 15) * s, e2m1_scaled(b >> 4) * s
    s = group_scale(base + S_OFF, n[:, None] * S_STRIDE + kb[None, :] // HG, mask, FMT)
    return e2m1_to_f32(b & 15) * s, e2m1_to_f32(b >> 4) * s


@triton.jit
def load_bias(base, B_OFF, n, N, BDT: tl.constexpr):
    """Output bias [BN] as fp32."""
    return tl.load((base + B_OFF).to(tl.pointer_type(BDT)) + n, mask=n < N, other=0.0).to(tl.float32)


@triton.jit
def tensor_scale(base, S_OFF, S2_OFF, FMT: tl.constexpr, S2_INV: tl.constexpr):
    """The factor a whole tile is multiplied by: FP8 per-tensor scale or NVFP4 second-level scale."""
    if FMT == FP8:
        return scalar_f32(base, S_OFF)
    elif FMT == NVFP4:
        s2 = scalar_f32(base, S2_OFF)
        if S2_INV:
            s2 = 1.0 / s2
        return s2
    else:
        return 1.0
