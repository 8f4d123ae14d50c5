/* FP4 (NVFP4 / MXFP4), FP8 and BF16 matvecs on the CPU over a block's stored bytes: kernels/cpu.py's native path.
 * One translation unit made of the parts in kernels/native/, included in order (each sees those before it, so the
 * compiler inlines across them as it did when they were one file): the shared tables and scratch, FP4, FP8, FP4 with
 * int8 activations (AVX-512 VNNI), BF16, one expert a call, a layer's experts by plan (FP4, then BF16 / FP8); here
 * the plan's two entry points.
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes, which releases the GIL for the call. E2M1 codes through a 16-entry table, scale bytes through
 * a 256-entry table, scales applied once per group. Vector paths: AVX-512 (codes zero-extended to 32-bit
 * lanes and looked up as floats by a permute; a re-laid down streams whole rows, each thread a run of
 * scale groups, all outputs' sums in L1), else AVX2 (pshufb on a 2 x E2M1 int8 table), else plain loops. Same arithmetic as
 * kernels/cpu.py's fp4_matvec up to summation order.
 *
 * Layouts (bytes as stored, row-major):
 *   n-major  packed [N, K2] (K2 = K/2, low nibble = even input), scales [N, *] row stride s_stride
 *   k-major  packed [K2, N] (a re-laid ReLU^2 down), scales [K2 / half, *] row stride s_stride
 * One scale per `half` bytes (8 for NVFP4's 16 values, 16 for MXFP4's 32); E4M3 or E8M0 scale bytes.
 * xe, xo: x's even and odd elements [K2]. y [N] is overwritten.
 */

#include "native/common.h"
#include "native/fp4.c"
#include "native/fp8.c"
#include "native/q8.c"
#include "native/bf16.c"
#include "native/experts.c"
#include "native/layers.c"
#include "native/dense.c"

int sluice_experts(const int64_t *plan, int n, const int64_t *bases, const float *x, float *y) {
    init_scales();
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I], M = (Dx > I ? Dx : I) / 2;
    const int half = (int)plan[P_HALF], e8m0 = (int)plan[P_E8M0], int8 = (int)plan[P_INT8], kind = (int)plan[P_KIND];
    if (kind == 2 || kind == 3)
        return dense_layer(plan, n, bases, x, y);
    if (kind != 0 && kind != 1)
        return 0;
    /* scratch, floats: xe, xo [Dx/2]; h or g [I]; u [I]; he, ho [I/2]; xs, c [M/4 + 1]; q [2M] int8 */
    const long need = Dx + 2 * I + I + 2 * (M / 4 + 1) + (2 * M + 3) / 4 + 16;
    if (need > plan_cap) {
        free(plan_buf);
        plan_buf = aligned_alloc(64, (size_t)((need + 15) / 16 * 16) * sizeof(float));
        plan_cap = plan_buf ? need : 0;
        if (!plan_buf)
            return 0;
    }
    float *xe = plan_buf, *xo = xe + Dx / 2, *h = xo + Dx / 2, *u = h + I, *he = u + I, *ho = he + I / 2, *xs = ho + I / 2;
    int32_t *c = (int32_t *)(xs + M / 4 + 1);
    int8_t *q = (int8_t *)(c + M / 4 + 1);
    for (long i = 0; i < Dx / 2; i++) {
        xe[i] = x[2 * i];
        xo[i] = x[2 * i + 1];
    }
#ifdef __AVX512BW__
    if (kind == 0 && relu2_layer(plan, n, bases, xe, xo, y, int8))
        return 1;
#endif
    if (kind == 1 && swiglu_layer(plan, n, bases, xe, xo, y, int8))
        return 1;
    for (int e = 0; e < n; e++) {
        const uint8_t *base = (const uint8_t *)(intptr_t)bases[e];
        const uint8_t *uw, *us, *dw, *ds;
        long ust, dst;
        float us2, ds2;
        plan_proj(plan, 0, base, &uw, &us, &ust, &us2);
        plan_proj(plan, 1, base, &dw, &ds, &dst, &ds2);
        float *ye = y + (long)e * Dx;
        if (kind == 0 && int8)
            sluice_fp4_relu2_expert_q8(uw, us, ust, us2, dw, ds, dst, ds2, xe, xo, Dx, I, half, e8m0, h, he, ho, ye, q, xs, c);
        else if (kind == 0)
            sluice_fp4_relu2_expert(uw, us, ust, us2, dw, ds, dst, ds2, xe, xo, Dx, I, half, e8m0, h, he, ho, ye);
        else {
            const uint8_t *gw, *gs;
            long gst;
            float gs2;
            plan_proj(plan, 2, base, &gw, &gs, &gst, &gs2);
            sluice_fp4_swiglu_expert(gw, gs, gst, gs2, uw, us, ust, us2, dw, ds, dst, ds2, xe, xo, Dx, I, half, e8m0, h, u, he, ho, ye,
                                     q, xs, c, int8);
        }
    }
    return 1;
}

/* fp32 -> bf16 bits, round to nearest even (torch's: a NaN becomes 0x7FC0) */
static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* y [n, Dx] -> out's rows: each rounded to bf16 (round_x) or not, times w[e] */
static void weigh(const float *y, int n, long Dx, const float *w, const int64_t *rows, int round_x, void *out, int out_bf16) {
    for (int e = 0; e < n; e++) {
        const float *ye = y + (long)e * Dx, we = w[e];
        float *of = (float *)out + rows[e] * Dx;
        uint16_t *ob = (uint16_t *)out + rows[e] * Dx;
        for (long j = 0; j < Dx; j++) {
            float v = round_x ? bits_f32((uint32_t)f32_bf16(ye[j]) << 16) : ye[j];
            v *= we;
            if (out_bf16)
                ob[j] = f32_bf16(v);
            else
                of[j] = v;
        }
    }
}

/* sluice_experts, then each expert's output [Dx] rounded to bf16 (round_x) or not, times its weight w[e], into row
 * rows[e] of out (fp32, out_bf16 = 0, or bf16 bits): the host's rows of a MoE layer in one call, as
 * `(y.to(x_dtype).float() * w[:, None]).to(out.dtype)` writes them (kernels/cpu.py `weighed_rows_ref`). */
int sluice_experts_rows(const int64_t *plan, int n, const int64_t *bases, const float *x, float *y, const float *w,
                        const int64_t *rows, int round_x, void *out, int out_bf16) {
    if (!sluice_experts(plan, n, bases, x, y))
        return 0;
    weigh(y, n, (long)plan[P_DX], w, rows, round_x, out, out_bf16);
    return 1;
}

/* sluice_experts_rows over n (block, row) pairs, pair e on its own input x[e] [Dx]: a prompt's blocks of few rows. A
 * block's pairs side by side run one after another with the same static shares of its weights per thread, so each
 * thread's share (~0.4 MB of a Nano block over 14 threads) is still in its cache for the block's next row: the block
 * is read from RAM once, however many rows it has (`sluice bench cpu --pairs` times what that saves). An FP4 block's
 * pairs go up to ROWS at a time, each weight decoded once for them (AVX-512: relu2_rows, swiglu_rows): the FP4 decode,
 * not RAM, bounds a row (BENCHMARKS.md, fourteenth set: 98 us a Nano block from cache, 113 from RAM). y: scratch
 * [ROWS, Dx]. */
int sluice_experts_pairs(const int64_t *plan, int n, const int64_t *bases, const float *x, float *y, const float *w,
                         const int64_t *rows, int round_x, void *out, int out_bf16) {
    const long Dx = (long)plan[P_DX];
    for (int e = 0, r = 1; e < n; e += r) {
#ifdef __AVX512BW__  /* an FP4 block's next pairs (up to ROWS) in one pass, each weight decoded once for them */
        init_scales();
        for (r = 1; e + r < n && r < ROWS && bases[e + r] == bases[e]; r++)
            ;
        const uint8_t *base = (const uint8_t *)(intptr_t)bases[e];
        if (r > 1 && !plan[P_INT8] && ((plan[P_KIND] == 0 && relu2_rows(plan, base, r, x + e * Dx, y)) ||
                                       (plan[P_KIND] == 1 && swiglu_rows(plan, base, r, x + e * Dx, y)))) {
            weigh(y, r, Dx, w + e, rows + e, round_x, out, out_bf16);
            continue;
        }
#endif
        r = 1;
        if (!sluice_experts_rows(plan, 1, bases + e, x + e * Dx, y, w + e, rows + e, round_x, out, out_bf16))
            return 0;
    }
    return 1;
}
