"""Triton device functions for the f16x2 formulations: weights converted two at a time by Hopper's e4m3 conversion
(`cvt.rn.f16x2.e4m3x2`, sm_89+) and multiplied with f16x2 FMAs against activations packed as scaled fp16 pairs.

NVFP4 scale groups of two words of eight nibbles (matvec), NVFP4 and FP8 re-laid down groups (16 neurons), FP8
words of four inputs (matvec); each in one inline-PTX call where `ASM`, else the same pairing in Triton fp16 (the
interpreter's path: mul + add where the PTX fuses, so not bit-identical). Pair packing: activations scaled by a power of two per row (x) or
per 16-value group (h) so that products and sums fit fp16; the unscale is applied in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sluice.kernels.dequant import e2m1_scaled

# FP4 through Hopper's e4m3 conversion (`fp4_pair_dot_f16x2`): an E2M1 nibble s.e1e0.m placed in an e4m3 byte as
# s 0 0 e1 e0 m 0 0 is the E2M1 value times 2**-6 (normals and the subnormal alike), so `cvt.rn.f16x2.e4m3x2` decodes
# two at a time; x comes as fp16 pairs (`x_pairs`: scaled by a power of two so no product overflows), and eight
# `fma.rn.f16x2` dot a scale group's two words before the sum's two halves meet in fp32. Pair J of word w: J 0
# (x0, x2), 1 (x4, x6), 2 (x1, x3), 3 (x5, x7), the first element in the low half.
# In the PTX: 471604252 = 0x1C1C1C1C (each byte's bits 2-4), -2139062144 = 0x80808080 (each byte's sign bit).


@triton.jit
def _f16_half(X, HI: tl.constexpr):
    """The low (HI 0) or high half of each int32 in X as fp16."""
    b = (X >> 16) if HI else (X & 0xFFFF)
    return b.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _nibble_f16(word, I: tl.constexpr):
    """Nibble I of each word as fp16: E2M1 value * 2**-6, what the e4m3 conversion gives."""
    return (e2m1_scaled((word >> (4 * I)) & 15) * 256.0).to(tl.float16)


def _e4m3_bytes(w: str, t: str, u: str, lo: str, hi: str) -> list[str]:
    """PTX lines: word w's nibbles as e4m3 bytes (s 0 0 e1 e0 m 0 0), lo the low nibbles' and hi the high nibbles',
    byte for byte; t and u scratch registers."""
    return [f"shl.b32 {t}, {w}, 2;", f"and.b32 {t}, {t}, 471604252;", f"shl.b32 {u}, {w}, 4;",
            f"and.b32 {u}, {u}, -2139062144;", f"or.b32 {lo}, {t}, {u};",
            f"shr.u32 {t}, {w}, 2;", f"and.b32 {t}, {t}, 471604252;", f"and.b32 {u}, {w}, -2139062144;",
            f"or.b32 {hi}, {t}, {u};"]


def _fp4_words_ptx(words: int) -> str:
    """PTX for fp4_pair_dot_f16x2 over `words` words ($1..): each word's nibbles become e4m3 pairs by shifts and
    masks, four f16x2 conversions, four f16x2 FMAs with its x pairs (the four operands after the words, word by word)
    into one f16x2 sum, whose halves are added in fp32 ($0)."""
    body = []
    for i in range(words):
        w, x = f"${1 + i}", 1 + words + 4 * i
        body += _e4m3_bytes(w, "sT", "sU", "sL", "sH") + ["mov.b32 {sS0, sS1}, sL;", "mov.b32 {sS2, sS3}, sH;"]
        body += [f"cvt.rn.f16x2.e4m3x2 sC{j}, sS{j};" for j in range(4)]
        body += [f"mul.rn.f16x2 sP, sC0, ${x};" if i == 0 else f"fma.rn.f16x2 sP, sC0, ${x}, sP;"]
        body += [f"fma.rn.f16x2 sP, sC{j}, ${x + j}, sP;" for j in range(1, 4)]
    body += ["mov.b32 {sQ0, sQ1}, sP;", "cvt.f32.f16 sF0, sQ0;", "cvt.f32.f16 sF1, sQ1;", "add.f32 sF0, sF0, sF1;",
             "mov.b32 $0, sF0;"]
    return ("{\n.reg .b32 sT, sU, sL, sH, sP;\n.reg .b32 sC<4>;\n.reg .b16 sS<4>, sQ<2>;\n.reg .f32 sF<2>;\n"
            + "\n".join(body) + "\n}")


FP4_PAIR_DOT_PTX = tl.constexpr(_fp4_words_ptx(2))
FP4_PAIR_DOT_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 10))


@triton.jit
def fp4_pair_dot_f16x2(word, word2, X0, X1, X2, X3, Y0, Y1, Y2, Y3, ASM: tl.constexpr):
    """sum_i E2M1(nibble i) * x_i * 2**-6 as fp32 over a scale group's two words of eight nibbles (word: inputs 0-7,
    X0..X3 their x pairs; word2: inputs 8-15, Y0..Y3), elementwise; the pairs are int32 bits of f16x2. Its sixteen
    products are summed in f16x2 (x scaled so that they and their sums fit fp16: `x_pair_scales`), the two halves in
    fp32. One scale group per call reads the group as one int64 and leaves the word sums in fp16 (fewer calls than one
    per word). ASM: one inline-PTX call (sm_89+); else the
    same pairing and fp16 products in Triton (the interpreter's path: mul + add where the PTX fuses, so not
    bit-identical)."""
    if ASM:
        r = tl.inline_asm_elementwise(asm=FP4_PAIR_DOT_PTX, constraints=FP4_PAIR_DOT_CONSTRAINTS,
                                      args=[word, word2, X0, X1, X2, X3, Y0, Y1, Y2, Y3], dtype=tl.int32, is_pure=True, pack=1)
        return r.to(tl.float32, bitcast=True)
    lo = _nibble_f16(word, 0) * _f16_half(X0, 0)
    hi = _nibble_f16(word, 2) * _f16_half(X0, 1)
    lo, hi = _word_halves(lo, hi, word, X0, X1, X2, X3, False)
    lo, hi = _word_halves(lo, hi, word2, Y0, Y1, Y2, Y3, True)
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _word_halves(lo, hi, word, X0, X1, X2, X3, FIRST_TOO: tl.constexpr):
    """The fp16 sums of the low and high halves of a word's pairs (as the PTX adds them), after lo and hi; the word's
    first pair is already in lo and hi unless FIRST_TOO."""
    if FIRST_TOO:
        lo = lo + _nibble_f16(word, 0) * _f16_half(X0, 0)
        hi = hi + _nibble_f16(word, 2) * _f16_half(X0, 1)
    lo = lo + _nibble_f16(word, 4) * _f16_half(X1, 0)
    lo = lo + _nibble_f16(word, 1) * _f16_half(X2, 0)
    lo = lo + _nibble_f16(word, 5) * _f16_half(X3, 0)
    hi = hi + _nibble_f16(word, 6) * _f16_half(X1, 1)
    hi = hi + _nibble_f16(word, 3) * _f16_half(X2, 1)
    hi = hi + _nibble_f16(word, 7) * _f16_half(X3, 1)
    return lo, hi


def _row_ptx(w: str) -> list[str]:
    """PTX lines: a re-laid down row's word w as four e4m3 pairs (each byte's low nibble with its high nibble, by two
    byte permutes), converted to f16x2 in c0..c3."""
    return (_e4m3_bytes(w, "tL", "tU", "sL", "sH") + ["prmt.b32 p0, sL, sH, 20800;", "prmt.b32 p1, sL, sH, 29538;",
                                                      "mov.b32 {q0, q1}, p0;", "mov.b32 {q2, q3}, p1;"]
            + [f"cvt.rn.f16x2.e4m3x2 c{j}, q{j};" for j in range(4)])


def _group_dot_ptx(rows: int) -> str:
    """PTX for fp4_group_dot_f16x2: per row, the word's four bytes become e4m3 pairs (low nibble, high nibble) by
    shifts, masks and two byte permutes (prmt), four f16x2 conversions, and four f16x2 FMAs with the row's h pair."""
    body = []
    for i in range(rows):
        body += _row_ptx(f"${4 + i}")
        op = "mul.rn.f16x2 a{j}, c{j}, ${h};" if i == 0 else "fma.rn.f16x2 a{j}, c{j}, ${h}, a{j};"
        body += [op.format(j=j, h=4 + rows + i) for j in range(4)]
    for j in range(4):
        body += [f"mov.b32 {{e0, e1}}, a{j};", "cvt.f32.f16 f0, e0;", "cvt.f32.f16 f1, e1;", "add.f32 f0, f0, f1;",
                 f"mov.b32 ${j}, f0;"]
    return ("{\n.reg .b32 tL, tU, sL, sH, p0, p1;\n.reg .b16 q<4>, e<2>;\n.reg .b32 c<4>, a<4>;\n.reg .f32 f<2>;\n"
            + "\n".join(body) + "\n}")


GROUP_DOT_PTX = tl.constexpr(_group_dot_ptx(8))
GROUP_DOT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))


@triton.jit
def fp4_group_dot_f16x2(W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7, ASM: tl.constexpr):
    """A re-laid FP4 down's 8 byte rows of one scale group (16 neurons), four outputs per int32 word: Wi the words of
    row i (byte j = output j's two nibbles, low = neuron 2i, high = 2i+1 of the group), Hi the int32 bits of that
    row's h pair as f16x2. Returns the four outputs' sums over the group (E2M1 * 2**-6 times h, fp32), as a tuple.
    Products and the group's sums in f16x2 (h is scaled so that they fit); the two halves added in fp32.
    ASM: one inline-PTX call (sm_89+); else the same pairing in Triton fp16 (mul + add where PTX fuses)."""
    if ASM:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            asm=GROUP_DOT_PTX,
            constraints=GROUP_DOT_CONSTRAINTS,
            args=[W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        return (d0.to(tl.float32, bitcast=True), d1.to(tl.float32, bitcast=True), d2.to(tl.float32, bitcast=True),
                d3.to(tl.float32, bitcast=True))
    return (_group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7, 0),
            _group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7, 1),
            _group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7, 2),
            _group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7, 3))


FP8_WORD_DOT_PTX = tl.constexpr("""
            {
            .reg .b32 c0, c1, p;
            .reg .b16 q0, q1;
            .reg .f32 f0, f1;
            mov.b32 {q0, q1}, $1;
            cvt.rn.f16x2.e4m3x2 c0, q0;
            cvt.rn.f16x2.e4m3x2 c1, q1;
            mul.rn.f16x2 p, c0, $2;
            fma.rn.f16x2 p, c1, $3, p;
            mov.b32 {q0, q1}, p;
            cvt.f32.f16 f0, q0;
            cvt.f32.f16 f1, q1;
            add.f32 f0, f0, f1;
            mov.b32 $0, f0;
            }
            """)


@triton.jit
def fp8_word_dot_f16x2(word, X0, X1, ASM: tl.constexpr):
    """sum_j E4M3(byte j of word) * x_j as fp32, elementwise over int32 words of four inputs; X0, X1 the word's x
    pairs (x0, x1) and (x2, x3) as f16x2 bits (`x_pairs` with fp8: scaled so that products and sums fit fp16). ASM: one
    inline-PTX call (sm_89+: two e4m3x2 conversions, two f16x2 FMAs); else the same pairing in Triton fp16."""
    if ASM:
        r = tl.inline_asm_elementwise(asm=FP8_WORD_DOT_PTX, constraints="=r,r,r,r", args=[word, X0, X1], dtype=tl.int32,
                                      is_pure=True, pack=1)
        return r.to(tl.float32, bitcast=True)
    lo = _e4m3_f16(word, 0) * _f16_half(X0, 0) + _e4m3_f16(word, 2) * _f16_half(X1, 0)
    hi = _e4m3_f16(word, 1) * _f16_half(X0, 1) + _e4m3_f16(word, 3) * _f16_half(X1, 1)
    return lo.to(tl.float32) + hi.to(tl.float32)


def _fp8_group_dot_ptx() -> str:
    """PTX for fp8_group_dot_f16x2: each h pair becomes two broadcast pairs (h, h) by byte permutes (prmt); each row's
    word, four E4M3 outputs, two f16x2 conversions and two f16x2 FMAs; the four sums to fp32."""
    body = []
    for p in range(8):
        body += [f"prmt.b32 hA, ${20 + p}, ${20 + p}, 4112;", f"prmt.b32 hB, ${20 + p}, ${20 + p}, 12850;"]  # 0x1010, 0x3232
        for r, hh in ((2 * p, "hA"), (2 * p + 1, "hB")):
            body += [f"mov.b32 {{q0, q1}}, ${4 + r};", "cvt.rn.f16x2.e4m3x2 c0, q0;", "cvt.rn.f16x2.e4m3x2 c1, q1;"]
            body += ([f"mul.rn.f16x2 a0, c0, {hh};", f"mul.rn.f16x2 a1, c1, {hh};"] if r == 0 else
                     [f"fma.rn.f16x2 a0, c0, {hh}, a0;", f"fma.rn.f16x2 a1, c1, {hh}, a1;"])
    for j, (a, half) in enumerate((("a0", "e0"), ("a0", "e1"), ("a1", "e0"), ("a1", "e1"))):
        body += [f"mov.b32 {{e0, e1}}, {a};", f"cvt.f32.f16 f0, {half};", f"mov.b32 ${j}, f0;"]
    return ("{\n.reg .b32 hA, hB, c0, c1, a0, a1;\n.reg .b16 q0, q1, e0, e1;\n.reg .f32 f0;\n" + "\n".join(body) + "\n}")


FP8_GROUP_DOT_PTX = tl.constexpr(_fp8_group_dot_ptx())
FP8_GROUP_DOT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 24))


@triton.jit
def fp8_group_dot_f16x2(W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15,
                        H0, H1, H2, H3, H4, H5, H6, H7, ASM: tl.constexpr):
    """A re-laid FP8 (E4M3) down's 16 neuron rows of one group, four outputs per int32 word: Wi the words of neuron i
    (byte j = output j), H0..H7 the int32 bits of the group's h pairs (h[2p], h[2p+1]) as f16x2. Returns the four
    outputs' sums over the group (fp32), as a tuple. Products and sums in f16x2 (h scaled so that they fit: `group_pairs`
    with FP8). ASM: one inline-PTX call (sm_89+); else the same in Triton fp16 (mul + add where PTX fuses)."""
    if ASM:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            asm=FP8_GROUP_DOT_PTX,
            constraints=FP8_GROUP_DOT_CONSTRAINTS,
            args=[W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15, H0, H1, H2, H3, H4, H5, H6, H7],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        return (d0.to(tl.float32, bitcast=True), d1.to(tl.float32, bitcast=True), d2.to(tl.float32, bitcast=True),
                d3.to(tl.float32, bitcast=True))
    return (_fp8_group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15, H0, H1, H2, H3, H4, H5, H6, H7, 0),
            _fp8_group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15, H0, H1, H2, H3, H4, H5, H6, H7, 1),
            _fp8_group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15, H0, H1, H2, H3, H4, H5, H6, H7, 2),
            _fp8_group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15, H0, H1, H2, H3, H4, H5, H6, H7, 3))


@triton.jit
def _e4m3_f16(word, J: tl.constexpr):
    """Byte J of each int32 word as an E4M3 value in fp16 (exact)."""
    return ((word >> (8 * J)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _row(acc, W, H, HI: tl.constexpr, J: tl.constexpr, FP8: tl.constexpr):
    """acc plus row W's weight for output J times half HI of the pair H, in fp16: FP8's byte J, or NVFP4's nibble
    2J + HI (the row's byte J holds both neurons of the pair)."""
    if FP8:
        w = _e4m3_f16(W, J)
    else:
        w = _nibble_f16(W, 2 * J + HI)
    return acc + w * _f16_half(H, HI)


@triton.jit
def _fp8_group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W13, W14, W15,
                        H0, H1, H2, H3, H4, H5, H6, H7, J: tl.constexpr):
    """fp8_group_dot_f16x2's output J in Triton fp16, summed in the PTX's order (row by row)."""
    acc = _e4m3_f16(W0, J) * _f16_half(H0, 0)
    acc = _row(acc, W1, H0, 1, J, True)
    acc = _row(_row(acc, W2, H1, 0, J, True), W3, H1, 1, J, True)
    acc = _row(_row(acc, W4, H2, 0, J, True), W5, H2, 1, J, True)
    acc = _row(_row(acc, W6, H3, 0, J, True), W7, H3, 1, J, True)
    acc = _row(_row(acc, W8, H4, 0, J, True), W9, H4, 1, J, True)
    acc = _row(_row(acc, W10, H5, 0, J, True), W11, H5, 1, J, True)
    acc = _row(_row(acc, W12, H6, 0, J, True), W13, H6, 1, J, True)
    acc = _row(_row(acc, W14, H7, 0, J, True), W15, H7, 1, J, True)
    return acc.to(tl.float32)


@triton.jit
def _group_dot_byte(W0, W1, W2, W3, W4, W5, W6, W7, H0, H1, H2, H3, H4, H5, H6, H7, J: tl.constexpr):
    """fp4_group_dot_f16x2's output J in Triton fp16: low-nibble and high-nibble products summed apart, then added."""
    lo = _nibble_f16(W0, 2 * J) * _f16_half(H0, 0)
    hi = _nibble_f16(W0, 2 * J + 1) * _f16_half(H0, 1)
    lo, hi = _row(lo, W1, H1, 0, J, False), _row(hi, W1, H1, 1, J, False)
    lo, hi = _row(lo, W2, H2, 0, J, False), _row(hi, W2, H2, 1, J, False)
    lo, hi = _row(lo, W3, H3, 0, J, False), _row(hi, W3, H3, 1, J, False)
    lo, hi = _row(lo, W4, H4, 0, J, False), _row(hi, W4, H4, 1, J, False)
    lo, hi = _row(lo, W5, H5, 0, J, False), _row(hi, W5, H5, 1, J, False)
    lo, hi = _row(lo, W6, H6, 0, J, False), _row(hi, W6, H6, 1, J, False)
    lo, hi = _row(lo, W7, H7, 0, J, False), _row(hi, W7, H7, 1, J, False)
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def x_pair_scales(mx):
    """For a row whose largest |x| is mx: (scale, 2**6 / scale), scale a power of two putting mx in [2**13, 2**14)
    (exponents clamped to normal floats): products of up to 6 * 2**-6 * 2**14 fit fp16, and so do the sums of eight
    of them that each half of an f16x2 sum holds for a scale group (at most 12288), in a matvec or a re-laid down."""
    return pair_scales(mx, 13, 6)


@triton.jit
def pair_scales(mx, P: tl.constexpr, F: tl.constexpr):
    """(scale, 2**F / scale) for values whose largest magnitude is mx: scale a power of two putting mx in
    [2**P, 2**(P + 1)), exponents clamped to normal floats; 2**F undoes the weights' own factor (the e4m3 trick's 2**-6)."""
    e = (mx.to(tl.int32, bitcast=True) >> 23) & 255
    # at most 2**126 and, with F < 1, short of it so that the unscale stays a normal float (tiny rows then scale less)
    sb = tl.minimum(tl.minimum(tl.maximum(P + 254 - e, 1), 254), 253 + F)
    return (sb << 23).to(tl.float32, bitcast=True), ((F + 254 - sb) << 23).to(tl.float32, bitcast=True)


@triton.jit
def x_pair(vp, w, wm, J: tl.constexpr, scale):
    """x pair J of words w (see above) as int32 bits of f16x2, x scaled by `scale`."""
    E0: tl.constexpr = 4 * (J % 2) + J // 2
    return f16x2_bits(tl.load(vp + w * 8 + E0, mask=wm, other=0.0), tl.load(vp + w * 8 + (E0 + 2), mask=wm, other=0.0), scale)


@triton.jit
def f16x2_bits(a, b, scale):
    """a * scale and b * scale rounded to fp16 and packed as int32 bits of f16x2 (a in the low half)."""
    lo = (a.to(tl.float32) * scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = (b.to(tl.float32) * scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def group_pairs(v, B: tl.constexpr, FP8: tl.constexpr):
    """v [B] fp32 (B a multiple of 16) -> (int32 [B/2]: f16x2 pairs (v[2p], v[2p+1]), fp32 [B/16]: unscales), each
    16-value group scaled by its own power of two: for NVFP4 weights `x_pair_scales`; for FP8 (FP8 true) the group's
    largest |v| in [4, 8), so that 16 products with E4M3 values (up to 448) and their sum fit fp16."""
    mx = tl.max(tl.abs(tl.reshape(v, [B // 16, 16])), axis=1)
    if FP8:
        scale, inv = pair_scales(mx, 2, 0)
    else:
        scale, inv = x_pair_scales(mx)
    lo, hi = tl.split(tl.reshape(v, [B // 2, 2]))
    return f16x2_bits(lo, hi, tl.reshape(tl.broadcast_to(scale[:, None], [B // 16, 8]), [B // 2])), inv


@triton.jit
def row_pair_scales(vp, K, BM: tl.constexpr, FP8: tl.constexpr):
    """`x_pair_scales` for the row of K values at vp (its largest |value| found BM at a time); for FP8 weights (FP8
    true) that largest |value| goes to [32, 64), so that two products with E4M3 values (up to 448) and their sum fit
    fp16 (`fp8_word_dot_f16x2`)."""
    m = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BM):
        k = k0 + tl.arange(0, BM)
        m = tl.maximum(m, tl.abs(tl.load(vp + k, mask=k < K, other=0.0).to(tl.float32)))
    if FP8:
        return pair_scales(tl.max(m, axis=0), 5, 0)
    return x_pair_scales(tl.max(m, axis=0))
