/* A layer's FP4 experts by plan: n experts of one layout on one token in one parallel region.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

/* ---- Experts by plan: one call for n experts of one layout (a layer's blocks) and one token, the work of
 * kernels/cpu_native.py's Python side (x split into even and odd elements, scratch, the second-level scales read
 * from each block) done here, so that a call costs a few microseconds of Python however many experts it takes.
 * plan: int64 fields P_*, built once per store layout (cpu_native.py ExpertPlan); bases [n]: each block's address;
 * x [Dx] fp32; y [n, Dx] fp32. Returns 0 (nothing done) for a plan it does not know. */
enum {
    P_KIND,  /* 0: ReLU^2 (up n-major, down re-laid k-major); 1: SwiGLU with plain SiLU (gate, up, down n-major) */
    P_INT8,  /* activations rounded to int8 per scale group (AVX-512 VNNI; the fp32 kernels where it cannot run) */
    P_DX, P_I, P_HALF, P_E8M0,
    P_PROJ,  /* then per projection (up, down, gate): weight offset, scale offset, scale row stride, s2 offset (-1:
              * none), s2 stored inverted */
    P_LEN = P_PROJ + 3 * 5
};

static __thread float *plan_buf;
static __thread long plan_cap;

/* a projection's addresses in a block, and its second-level scale as the output's factor */
static inline void plan_proj(const int64_t *plan, int j, const uint8_t *base, const uint8_t **w, const uint8_t **s, long *stride,
                             float *s2) {
    const int64_t *f = plan + P_PROJ + 5 * j;
    *w = base + f[0];
    *s = base + f[1];
    *stride = (long)f[2];
    *s2 = 1.0f;
    if (f[3] >= 0) {
        float v;
        memcpy(&v, base + f[3], 4);
        *s2 = f[4] ? 1.0f / v : v;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define Q8_LAYERS 1
#else
#define Q8_LAYERS 0
#endif

#if Q8_LAYERS
/* x quantized per scale group once for a layer's experts, by the calling team (an `omp for`: ends in a barrier) */
static inline void q8_team_x(const float *xe, const float *xo, long K2u, int half, int8_t *xq, float *xs, int32_t *xc) {
#pragma omp for schedule(static)
    for (long g0 = 0; g0 < K2u; g0 += half)
        q8_group(xe, xo, g0, half, xq, xq + K2u, xs, xc);
}
#endif

#ifdef __AVX512BW__
/* A layer's n ReLU^2 FP4 experts on one token in one parallel region, with int8 activations (int8) or fp32: x
 * quantized once (int8); every expert's up rows in one `omp for`; each expert's activation (quantized by group); the
 * n experts' down groups split into one run per thread (a run crossing from one expert into the next keeps a partial
 * sum for each); then each expert's partial sums added in thread order, times its down_s2. Four barriers a layer
 * where expert by expert took four an expert, and the down projection's groups spread over the team whatever their
 * count per expert (one expert's 116 over 16 threads left some threads an eighth more than others). Static shares:
 * rows and runs to whichever thread was free timed the same in the engine and stalled calls beside busy cores
 * (BENCHMARKS.md, sixteenth set). Per expert the arithmetic is the single expert's (sluice_fp4_relu2_expert_q8,
 * sluice_fp4_relu2_expert) up to fp32 summation order. 0 where it cannot run. */
static int relu2_layer(const int64_t *plan, int n, const int64_t *bases, const float *xe, const float *xo, float *y, int int8) {
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I], K2u = Dx / 2, K2d = I / 2;
    const int half = (int)plan[P_HALF], e8m0 = (int)plan[P_E8M0];
    if (n < 1 || Dx % 64 || K2u % half || K2d % half || half % 4 || (int8 && (!Q8_LAYERS || K2u % 64)))
        return 0;
    const int T = omp_get_max_threads();
    const long Gd = K2d / half, Gall = n * Gd, chunks = Dx / 64;
    const long span = n;  /* a thread's run of down groups may touch every expert (a team smaller than T included) */
    if (!layer_scratch((size_t)(4 * K2u + 4 * n * I + 8 * n * K2d + 4 * n * K2d) + 4 * (size_t)T * (span + 1) * Dx + 64 * 11))
        return 0;
    size_t at = 0;
    int8_t *xq = carve(&at, 2 * K2u);
    float *xs = carve(&at, K2u), *h = carve(&at, 4 * n * I), *he = carve(&at, 4 * n * K2d), *ho = carve(&at, 4 * n * K2d);
    int32_t *xc = carve(&at, K2u);
    int8_t *hq = carve(&at, 2 * n * K2d);
    float *hs = carve(&at, n * K2d);
    int32_t *hc = carve(&at, n * K2d);
    float *acc = carve(&at, 4 * (size_t)T * span * Dx), *parts = carve(&at, 4 * (size_t)T * Dx);
    (void)xq, (void)xs, (void)xc, (void)hq, (void)hs, (void)hc;
    const uint8_t *uw[n], *us[n], *dw[n], *ds[n];
    long ust[n], dst[n];
    float us2[n], ds2[n];
    for (int e = 0; e < n; e++) {
        const uint8_t *base = (const uint8_t *)(intptr_t)bases[e];
        plan_proj(plan, 0, base, &uw[e], &us[e], &ust[e], &us2[e]);
        plan_proj(plan, 1, base, &dw[e], &ds[e], &dst[e], &ds2[e]);
    }
#pragma omp parallel num_threads(T)
    {
#if Q8_LAYERS
        float sc[Q8_SEG] __attribute__((aligned(64)));
        const q8_consts k = q8_nconsts(half);
        if (int8)
            q8_team_x(xe, xo, K2u, half, xq, xs, xc);
#endif
#pragma omp for schedule(static)
        for (long r = 0; r < n * I; r++) {
            const long e = r / I, i = r % I;
#if Q8_LAYERS
            if (int8) {
                h[r] = q8_nrow(&k, uw[e] + i * K2u, us[e] + i * ust[e], xq, xq + K2u, xs, xc, K2u, K2u / half, e8m0, sc);
                continue;
            }
#endif
            h[r] = fp4_row(uw[e] + i * K2u, us[e] + i * ust[e], xe, xo, K2u, half, e8m0);
        }
#pragma omp for schedule(static)
        for (long gg = 0; gg < Gall; gg++) {  /* an expert's group of h: the activation (then its quantization) */
            const long e = gg / Gd, g0 = gg % Gd * half;
            relu2_pairs(h + e * I, us2[e], g0, g0 + half, he + e * K2d, ho + e * K2d);
#if Q8_LAYERS
            if (int8)
                q8_group(he + e * K2d, ho + e * K2d, g0, half, hq + 2 * K2d * e, hq + 2 * K2d * e + K2d, hs + e * (K2d / 4),
                         hc + e * (K2d / 4));
#endif
        }
        const int t = omp_get_thread_num(), used = omp_get_num_threads();
        const long a = Gall * t / used, b = Gall * (t + 1) / used;
        float *mine = acc + (size_t)t * span * Dx;
        if (a < b) {
            memset(mine, 0, sizeof(float) * (size_t)((b - 1) / Gd - a / Gd + 1) * Dx);
            for (long gg = a; gg < b; gg++) {
                const long e = gg / Gd, g = gg % Gd;
                float *to = mine + (e - a / Gd) * Dx;
#if Q8_LAYERS
                if (int8) {
                    q8_kgroup(to, dw[e], ds[e] + g * dst[e], hq + 2 * K2d * e, hq + 2 * K2d * e + K2d, hs + e * (K2d / 4),
                              hc + e * (K2d / 4), Dx, g * half, half, e8m0);
                    continue;
                }
#endif
                fp4_kgroup(to, parts + (size_t)t * Dx, dw[e], ds[e] + g * dst[e], he + e * K2d, ho + e * K2d, Dx, g * half,
                           g * half + half, e8m0);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long c = 0; c < n * chunks; c++) {
            const long e = c / chunks, n0 = c % chunks * 64;
            float *from[used];
            int np = 0;
            for (int u = 0; u < used; u++) {  /* the threads whose runs took groups of expert e, in thread order */
                const long ua = Gall * u / used, ub = Gall * (u + 1) / used;
                if (ua < ub && ua < (e + 1) * Gd && ub > e * Gd)
                    from[np++] = acc + (size_t)u * span * Dx + (e - ua / Gd) * Dx;
            }
#if Q8_LAYERS
            if (int8) {
                q8_kunpermute(from, np, n0, ds2[e], y + e * Dx);
                continue;
            }
#endif
            for (long m = n0; m < n0 + 64; m += 16) {
                __m512 v = _mm512_loadu_ps(from[0] + m);
                for (int u = 1; u < np; u++)
                    v = _mm512_add_ps(v, _mm512_loadu_ps(from[u] + m));
                _mm512_storeu_ps(y + e * Dx + m, _mm512_mul_ps(v, _mm512_set1_ps(ds2[e])));
            }
        }
    }
    return 1;
}
#endif

#ifdef __AVX512BW__
/* x [r, Dx] -> its rows' even and odd elements (xe, xo [r, Dx/2]); row q's pointers into them (xes, xos) and into
 * the activation's he, ho [r, K2d] (hes, hos) */
static void rows_split(const float *x, int r, long Dx, long K2d, float *xe, float *xo, const float *he, const float *ho,
                       const float **xes, const float **xos, const float **hes, const float **hos) {
    const long K2u = Dx / 2;
    for (int q = 0; q < r; q++) {
        xes[q] = xe + q * K2u, xos[q] = xo + q * K2u, hes[q] = he + q * K2d, hos[q] = ho + q * K2d;
        for (long i = 0; i < K2u; i++) {
            xe[q * K2u + i] = x[q * Dx + 2 * i];
            xo[q * K2u + i] = x[q * Dx + 2 * i + 1];
        }
    }
}

/* One ReLU^2 FP4 block on r <= ROWS inputs (x [r, Dx] fp32; a prompt's rows of the block, sluice_experts_pairs) in one
 * parallel region: relu2_layer's steps for n = 1 with each weight decoded once for the r inputs (fp4_row_multi,
 * fp4_kgroup_multi), the down groups split over the team as relu2_layer splits one expert's, so that each output row
 * is relu2_layer's on that input bit for bit -> y [r, Dx]. fp32 activations only; 0 where it cannot run. */
static int relu2_rows(const int64_t *plan, const uint8_t *base, int r, const float *x, float *y) {
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I], K2u = Dx / 2, K2d = I / 2;
    const int half = (int)plan[P_HALF], e8m0 = (int)plan[P_E8M0];
    if (r < 1 || r > ROWS || Dx % 64 || K2u % half || K2d % half || half % 4)
        return 0;
    const int T = omp_get_max_threads();
    const long Gd = K2d / half, chunks = Dx / 64;
    if (!layer_scratch(4 * (size_t)r * (Dx + I + 2 * K2d + 2 * (size_t)T * Dx) + 64 * (6 + 4 * ROWS)))
        return 0;
    size_t at = 0;
    float *xe = carve(&at, 4 * (size_t)r * K2u), *xo = carve(&at, 4 * (size_t)r * K2u), *h = carve(&at, 4 * (size_t)r * I);
    float *he = carve(&at, 4 * (size_t)r * K2d), *ho = carve(&at, 4 * (size_t)r * K2d);
    float *acc = carve(&at, 4 * (size_t)T * r * Dx), *parts = carve(&at, 4 * (size_t)T * r * Dx);
    const uint8_t *uw, *us, *dw, *ds;
    long ust, dst;
    float us2, ds2;
    plan_proj(plan, 0, base, &uw, &us, &ust, &us2);
    plan_proj(plan, 1, base, &dw, &ds, &dst, &ds2);
    const float *xes[ROWS], *xos[ROWS], *hes[ROWS], *hos[ROWS];
    rows_split(x, r, Dx, K2d, xe, xo, he, ho, xes, xos, hes, hos);
#pragma omp parallel num_threads(T)
    {
        float out[ROWS];
#pragma omp for schedule(static)
        for (long i = 0; i < I; i++) {
            fp4_row_multi(uw + i * K2u, us + i * ust, xes, xos, r, K2u, half, e8m0, out);
            for (int q = 0; q < r; q++)
                h[q * I + i] = out[q];
        }
#pragma omp for schedule(static)
        for (long gg = 0; gg < r * Gd; gg++) {
            const long q = gg / Gd, g0 = gg % Gd * half;
            relu2_pairs(h + q * I, us2, g0, g0 + half, he + q * K2d, ho + q * K2d);
        }
        const int t = omp_get_thread_num(), used = omp_get_num_threads();
        const long a = Gd * t / used, b = Gd * (t + 1) / used;
        float *mine[ROWS], *part[ROWS];
        for (int q = 0; q < r; q++)
            mine[q] = acc + ((size_t)t * r + q) * Dx, part[q] = parts + ((size_t)t * r + q) * Dx;
        if (a < b) {
            memset(acc + (size_t)t * r * Dx, 0, sizeof(float) * (size_t)r * Dx);
            for (long g = a; g < b; g++)
                fp4_kgroup_multi(mine, part, r, dw, ds + g * dst, hes, hos, Dx, g * half, g * half + half, e8m0);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long c = 0; c < r * chunks; c++) {
            const long q = c / chunks, n0 = c % chunks * 64;
            for (long m = n0; m < n0 + 64; m += 16) {
                __m512 v = _mm512_setzero_ps();
                int any = 0;
                for (int u = 0; u < used; u++) {  /* the threads whose runs took groups, in thread order */
                    if (Gd * u / used >= Gd * (u + 1) / used)
                        continue;
                    const __m512 from = _mm512_loadu_ps(acc + ((size_t)u * r + q) * Dx + m);
                    v = any ? _mm512_add_ps(v, from) : from;
                    any = 1;
                }
                _mm512_storeu_ps(y + q * Dx + m, _mm512_mul_ps(v, _mm512_set1_ps(ds2)));
            }
        }
    }
    return 1;
}
#endif

/* A layer's n SwiGLU FP4 experts (plain SiLU) on one token in one parallel region, int8 activations or fp32: x
 * quantized once (int8); every expert's gate and up rows in one `omp for`; silu(g) * u (quantized by group) per
 * expert; every expert's down rows in one `omp for`. Each output is one row's dot, so the result is
 * sluice_fp4_swiglu_expert's bit for bit whatever the split. 0 where it cannot run. */
static int swiglu_layer(const int64_t *plan, int n, const int64_t *bases, const float *xe, const float *xo, float *y, int int8) {
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I], K2u = Dx / 2, K2d = I / 2;
    const int half = (int)plan[P_HALF], e8m0 = (int)plan[P_E8M0];
    if (n < 1 || K2u % half || K2d % half || half % 4 || (int8 && (!Q8_LAYERS || K2u % 64 || K2d % 64)))
        return 0;
    const int T = omp_get_max_threads();
    const long Gd = K2d / half;
    if (!layer_scratch((size_t)(4 * K2u + 8 * n * I + 8 * n * K2d + 4 * n * K2d) + 64 * 9))
        return 0;
    size_t at = 0;
    int8_t *xq = carve(&at, 2 * K2u);
    float *xs = carve(&at, K2u);
    int32_t *xc = carve(&at, K2u);
    float *gu = carve(&at, 4 * 2 * n * I), *he = carve(&at, 4 * n * K2d), *ho = carve(&at, 4 * n * K2d);
    int8_t *hq = carve(&at, 2 * n * K2d);
    float *hs = carve(&at, n * K2d);
    int32_t *hc = carve(&at, n * K2d);
    const uint8_t *w[3][n], *sc_[3][n];
    long st[3][n];
    float s2[3][n];
    for (int e = 0; e < n; e++)
        for (int j = 0; j < 3; j++)  /* 0 up, 1 down, 2 gate */
            plan_proj(plan, j, (const uint8_t *)(intptr_t)bases[e], &w[j][e], &sc_[j][e], &st[j][e], &s2[j][e]);
    (void)xq, (void)xs, (void)xc, (void)hq, (void)hs, (void)hc;
#pragma omp parallel num_threads(T)
    {
#if Q8_LAYERS
        float sc[Q8_SEG] __attribute__((aligned(64)));
        const q8_consts k = q8_nconsts(half);
        if (int8)
            q8_team_x(xe, xo, K2u, half, xq, xs, xc);
#endif
#pragma omp for schedule(static)
        for (long r = 0; r < 2 * n * I; r++) {  /* expert e's gate rows at gu[2 e I ..], its up rows after them */
            const long e = r / (2 * I), i = r % I;
            const int j = r % (2 * I) < I ? 2 : 0;
#if Q8_LAYERS
            if (int8) {
                gu[r] = q8_nrow(&k, w[j][e] + i * K2u, sc_[j][e] + i * st[j][e], xq, xq + K2u, xs, xc, K2u, K2u / half, e8m0, sc);
                continue;
            }
#endif
            gu[r] = fp4_row(w[j][e] + i * K2u, sc_[j][e] + i * st[j][e], xe, xo, K2u, half, e8m0);
        }
#pragma omp for schedule(static)
        for (long gg = 0; gg < n * Gd; gg++) {  /* an expert's group of silu(g) * u (then its quantization) */
            const long e = gg / Gd, g0 = gg % Gd * half;
            const float *ge = gu + 2 * e * I, *ue = ge + I;
            for (long i = 2 * g0; i < 2 * (g0 + half); i++) {
                float a = ge[i] * s2[2][e], b = ue[i] * s2[0][e];
                float h = a / (1.0f + __builtin_expf(-a)) * b;
                if (i % 2)
                    ho[e * K2d + i / 2] = h;
                else
                    he[e * K2d + i / 2] = h;
            }
#if Q8_LAYERS
            if (int8)
                q8_group(he + e * K2d, ho + e * K2d, g0, half, hq + 2 * K2d * e, hq + 2 * K2d * e + K2d, hs + e * (K2d / 4),
                         hc + e * (K2d / 4));
#endif
        }
#pragma omp for schedule(static)
        for (long r = 0; r < n * Dx; r++) {
            const long e = r / Dx, i = r % Dx;
#if Q8_LAYERS
            if (int8) {
                y[r] = q8_nrow(&k, w[1][e] + i * K2d, sc_[1][e] + i * st[1][e], hq + 2 * K2d * e, hq + 2 * K2d * e + K2d,
                               hs + e * (K2d / 4), hc + e * (K2d / 4), K2d, Gd, e8m0, sc) * s2[1][e];
                continue;
            }
#endif
            y[r] = fp4_row(w[1][e] + i * K2d, sc_[1][e] + i * st[1][e], he + e * K2d, ho + e * K2d, K2d, half, e8m0) * s2[1][e];
        }
    }
    return 1;
}

#ifdef __AVX512BW__
/* One SwiGLU FP4 block on r <= ROWS inputs (x [r, Dx] fp32), as relu2_rows: swiglu_layer's steps for n = 1 with
 * each weight row decoded once for the r inputs (fp4_row_multi); each output is one row's dot, so y [r, Dx] is
 * swiglu_layer's on each input bit for bit. fp32 activations only; 0 where it cannot run. */
static int swiglu_rows(const int64_t *plan, const uint8_t *base, int r, const float *x, float *y) {
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I], K2u = Dx / 2, K2d = I / 2;
    const int half = (int)plan[P_HALF], e8m0 = (int)plan[P_E8M0];
    if (r < 1 || r > ROWS || K2u % half || K2d % half || half % 4)
        return 0;
    const int T = omp_get_max_threads();
    const long Gd = K2d / half;
    if (!layer_scratch(4 * (size_t)r * (Dx + 2 * I + I) + 64 * 5))
        return 0;
    size_t at = 0;
    float *xe = carve(&at, 4 * (size_t)r * K2u), *xo = carve(&at, 4 * (size_t)r * K2u), *gu = carve(&at, 4 * 2 * (size_t)r * I);
    float *he = carve(&at, 4 * (size_t)r * K2d), *ho = carve(&at, 4 * (size_t)r * K2d);
    const uint8_t *w[3], *sc[3];
    long st[3];
    float s2[3];
    for (int j = 0; j < 3; j++)  /* 0 up, 1 down, 2 gate */
        plan_proj(plan, j, base, &w[j], &sc[j], &st[j], &s2[j]);
    const float *xes[ROWS], *xos[ROWS], *hes[ROWS], *hos[ROWS];
    rows_split(x, r, Dx, K2d, xe, xo, he, ho, xes, xos, hes, hos);
#pragma omp parallel num_threads(T)
    {
        float out[ROWS];
#pragma omp for schedule(static)
        for (long k = 0; k < 2 * I; k++) {  /* input q's gate rows at gu[2 q I ..], its up rows after them */
            const int j = k < I ? 2 : 0;
            const long i = k % I;
            fp4_row_multi(w[j] + i * K2u, sc[j] + i * st[j], xes, xos, r, K2u, half, e8m0, out);
            for (int q = 0; q < r; q++)
                gu[2 * q * I + k] = out[q];
        }
#pragma omp for schedule(static)
        for (long gg = 0; gg < r * Gd; gg++) {  /* input q's group of silu(g) * u */
            const long q = gg / Gd, g0 = gg % Gd * half;
            const float *ge = gu + 2 * q * I, *ue = ge + I;
            for (long i = 2 * g0; i < 2 * (g0 + half); i++) {
                float a = ge[i] * s2[2], b = ue[i] * s2[0];
                float h = a / (1.0f + __builtin_expf(-a)) * b;
                if (i % 2)
                    ho[q * K2d + i / 2] = h;
                else
                    he[q * K2d + i / 2] = h;
            }
        }
#pragma omp for schedule(static)
        for (long i = 0; i < Dx; i++) {
            fp4_row_multi(w[1] + i * K2d, sc[1] + i * st[1], hes, hos, r, K2d, half, e8m0, out);
            for (int q = 0; q < r; q++)
                y[q * Dx + i] = out[q] * s2[1];
        }
    }
    return 1;
}
#endif
