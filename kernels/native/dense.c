/* A layer's BF16 / FP8 experts by plan.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

/* ---- BF16 / FP8 experts by plan (P_KIND 2: ReLU^2, 3: SwiGLU with plain SiLU): per projection D_LEN fields from
 * P_PROJ on (up, down, gate): weight offset, type (1 BF16, 2 E4M3), k-major (re-laid), scale kind (0 none, 1 one F32
 * for the tensor, 2 one F32 per output, 3 F32 per block x block tile, 4 E8M0 per tile), scale offset, scale row
 * stride, tile edge. Each output is the single projection's (sluice_bf16_* / sluice_fp8_*, then the tensor or output
 * scale as kernels/cpu.py applies it) whatever the split, but for a re-laid E4M3 down (fp8_krows_team: the same sums
 * up to fp32 summation order). */
enum { D_W, D_TYPE, D_KMAJOR, D_SKIND, D_S, D_SSTRIDE, D_BLOCK, D_LEN };

typedef struct {
    const uint8_t *w, *s;
    long s_stride, block;
    int type, kmajor, skind;
} dense_proj;

static inline dense_proj dense_proj_of(const int64_t *plan, int j, const uint8_t *base) {
    const int64_t *f = plan + P_PROJ + D_LEN * j;
    dense_proj p = {base + f[D_W], f[D_SKIND] ? base + f[D_S] : NULL, (long)f[D_SSTRIDE], (long)f[D_BLOCK], (int)f[D_TYPE],
                    (int)f[D_KMAJOR], (int)f[D_SKIND]};
    return p;
}

static inline float dense_scaled(const dense_proj *p, float v, long n) {
    return p->skind == 1 ? v * ((const float *)p->s)[0] : p->skind == 2 ? v * ((const float *)p->s)[n] : v;
}

/* one projection of n experts (N outputs, K inputs; expert e's input at x + e * xstride, its outputs at y + e * N),
 * split over the calling team: n-major rows, or k-major chunks of 64 outputs. An `omp for`: ends in a barrier. */
static void dense_team(const dense_proj *ps, int n, const float *x, long xstride, long N, long K, float *y) {
    if (ps[0].kmajor) {
        const long chunks = (N + 63) / 64;
#pragma omp for schedule(static)
        for (long c = 0; c < n * chunks; c++) {
            const long e = c / chunks, n0 = c % chunks * 64, end = n0 + 64 < N ? n0 + 64 : N;
            const dense_proj *p = ps + e;
            float *ye = y + e * N;
            if (p->type == 1)
                bf16_chunk((const uint16_t *)p->w, x + e * xstride, N, K, n0, ye);
            else
                fp8_chunk(p->w, p->skind >= 3 ? p->s : NULL, p->s_stride, p->block, p->skind == 4, x + e * xstride, N, K, n0, ye);
            for (long i = n0; i < end; i++)
                ye[i] = dense_scaled(p, ye[i], i);
        }
    } else {
#pragma omp for schedule(static)
        for (long r = 0; r < n * N; r++) {
            const long e = r / N, i = r % N;
            const dense_proj *p = ps + e;
            const float v = p->type == 1 ? bf16_row((const uint16_t *)p->w + i * K, x + e * xstride, K)
                                         : fp8_row(p->w + i * K, p->skind >= 3 ? p->s : NULL, p->s_stride, p->block, p->skind == 4,
                                                   x + e * xstride, i, K);
            y[r] = dense_scaled(p, v, i);
        }
    }
}

#ifdef __AVX512F__
/* k-major (re-laid) E4M3 projections of n experts split over the calling team by runs of row units (R rows a unit: a
 * scale tile's edge, or 128 without tiles; a run crossing from one expert into the next keeps a sum for each), each
 * unit's rows streamed whole, two at a time, into a partial sum of all N outputs (in L1), then scaled by the unit's
 * tile scales into the thread's sum for its expert; after a barrier each expert's sums are added in thread order and
 * given the tensor or output scale. The 64-output chunks (fp8_chunk) read 64 bytes a row at the row's stride: 56-58%
 * of the RAM read rate on the H200's host. N a multiple of 16; acc [T, span, N], part [T, N]; the same sums as
 * fp8_chunk's up to fp32 summation order. */
static void fp8_krows_team(const dense_proj *ps, int n, const float *x, long xstride, long N, long K, float *y, float *acc,
                           float *part_all, long span) {
    const long R = ps[0].skind >= 3 ? ps[0].block : 128, per = (K + R - 1) / R, U = n * per;
    const int t = omp_get_thread_num(), used = omp_get_num_threads();
    const long a = U * t / used, b = U * (t + 1) / used;
    float *mine = acc + (size_t)t * span * N, *part = part_all + (size_t)t * N;
    if (a < b)
        memset(mine, 0, sizeof(float) * (size_t)((b - 1) / per - a / per + 1) * N);
    for (long uu = a; uu < b; uu++) {
        const long e = uu / per, kb = uu % per, k1 = kb * R + R < K ? kb * R + R : K;
        const dense_proj *p = ps + e;
        const float *xe = x + e * xstride;
        float *to = mine + (e - a / per) * N;
        long k = kb * R;
        for (long m = 0; m < N; m++)
            part[m] = 0.0f;
        for (; k < k1; k += 2) {  /* two rows a pass (the second a zero row at an odd end) */
            const uint8_t *r0 = p->w + k * N, *r1 = k + 1 < k1 ? r0 + N : r0;
            const __m512 x0 = _mm512_set1_ps(256.0f * xe[k]), x1 = _mm512_set1_ps(k + 1 < k1 ? 256.0f * xe[k + 1] : 0.0f);
            for (long m = 0; m < N; m += 16) {
                if (!(m & 63)) {
                    prefetch(r0 + m + PF_KROW);
                    prefetch(r1 + m + PF_KROW);
                }
                __m512 v = _mm512_fmadd_ps(e4m3x16(r0 + m), x0, _mm512_loadu_ps(part + m));
                _mm512_storeu_ps(part + m, _mm512_fmadd_ps(e4m3x16(r1 + m), x1, v));
            }
        }
        if (p->skind >= 3)
            for (long m = 0; m < N; m++)
                to[m] += part[m] * block_scale(p->s, kb * p->s_stride + m / p->block, p->skind == 4);
        else
            for (long m = 0; m < N; m++)
                to[m] += part[m];
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (long c = 0; c < n * (N / 16); c++) {
        const long e = c / (N / 16), m0 = c % (N / 16) * 16;
        __m512 v = _mm512_setzero_ps();
        int first = 1;
        for (int u = 0; u < used; u++) {  /* the threads whose runs took units of expert e, in thread order */
            const long ua = U * u / used, ub = U * (u + 1) / used;
            if (ua < ub && ua < (e + 1) * per && ub > e * per) {
                const __m512 w = _mm512_loadu_ps(acc + (size_t)u * span * N + (e - ua / per) * N + m0);
                v = first ? w : _mm512_add_ps(v, w);
                first = 0;
            }
        }
        float *ye = y + e * N;
        _mm512_storeu_ps(ye + m0, v);
        for (long i = m0; i < m0 + 16; i++)
            ye[i] = dense_scaled(ps + e, ye[i], i);
    }
}
#endif

/* a layer's n BF16 / FP8 experts on one token in one parallel region: each projection of every expert in one
 * `omp for`, the activation between them in another */
static int dense_layer(const int64_t *plan, int n, const int64_t *bases, const float *x, float *y) {
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I];
    const int swiglu = plan[P_KIND] == 3, T = omp_get_max_threads();
    if (n < 1)
        return 0;
    dense_proj up[n], down[n], gate[n];
    for (int e = 0; e < n; e++) {
        const uint8_t *base = (const uint8_t *)(intptr_t)bases[e];
        up[e] = dense_proj_of(plan, 0, base);
        down[e] = dense_proj_of(plan, 1, base);
        if (swiglu)
            gate[e] = dense_proj_of(plan, 2, base);
    }
#ifdef __AVX512F__
    /* a re-laid E4M3 down by runs of rows (fp8_krows_team) */
    const int rows = down[0].type == 2 && down[0].kmajor && Dx % 16 == 0 && (down[0].skind < 3 || down[0].block > 0);
#else
    const int rows = 0;
#endif
    const long span = rows ? n : 0;  /* a thread's run of row units may touch every expert (a team smaller than T included) */
    if (!layer_scratch(sizeof(float) * ((size_t)(3 * n * I) + (size_t)T * (span + 1) * Dx) + 64 * 5))
        return 0;
    size_t at = 0;
    float *h = carve(&at, 4 * n * I), *u = carve(&at, 4 * n * I), *a = carve(&at, 4 * n * I);
    float *acc = carve(&at, 4 * (size_t)T * span * Dx), *part = carve(&at, 4 * (size_t)T * Dx);
    (void)acc, (void)part;
    init_scales();
#pragma omp parallel num_threads(T)
    {
        dense_team(up, n, x, 0, I, Dx, swiglu ? u : h);
        if (swiglu)
            dense_team(gate, n, x, 0, I, Dx, h);
#pragma omp for schedule(static)
        for (long r = 0; r < n * I; r++) {
            const float v = h[r];
            a[r] = swiglu ? v / (1.0f + __builtin_expf(-v)) * u[r] : (v > 0.0f || v != v ? v * v : 0.0f);
        }
#ifdef __AVX512F__
        if (rows)
            fp8_krows_team(down, n, a, I, Dx, I, y, acc, part, span);
        else
#endif
            dense_team(down, n, a, I, Dx, I, y);
    }
    return 1;
}
