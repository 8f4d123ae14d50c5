/* FP4 with int8 activations (AVX-512 VNNI).
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

/* ---- FP4 with int8 activations (AVX-512 VNNI): x quantized per scale group to int8, products summed in int32 by
 * vpdpbusd, 64 weight bytes (128 nibbles) a step. The unsigned operand is the weight: a 16-entry table gives
 * 2 * E2M1 + 12 (0..24), and 12 * (the group's quantized x) is subtracted back (the sums start from it). Per group g of `half` bytes:
 *   y_n += wscale[n, g] * xs[g] / 2 * sum_j (2 E2M1(w_nj)) * q_j,   q_j = rint(x_j / xs[g]),  xs[g] = max|x| / 127
 * Exact integer sums within a group; the rounding of x to 8 bits is the approximation (kernels/cpu.py q8_reference).
 *
 * sluice_q8_prep: xe, xo [K2] -> qe, qo [K2] int8; xs_lane [K2/4] (each 4-byte quad's group scale / 2);
 *                 corr [K2/4] (-12 * the quad's sum of qe + qo). K2 a multiple of `half` (8 or 16). */

int sluice_q8_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
    return 1;
#else
    return 0;
#endif
}

/* one scale group of x (elements g0 .. g0 + half of xe and xo) quantized */
static inline void q8_group(const float *xe, const float *xo, long g0, int half, int8_t *qe, int8_t *qo, float *xs_lane,
                            int32_t *corr) {
    float m = 0.0f;
    for (long j = g0; j < g0 + half; j++) {
        float a = xe[j] < 0 ? -xe[j] : xe[j], b = xo[j] < 0 ? -xo[j] : xo[j];
        m = a > m ? a : m;
        m = b > m ? b : m;
    }
    float s = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
    for (long j = g0; j < g0 + half; j++) {
        qe[j] = (int8_t)__builtin_lrintf(xe[j] * inv);
        qo[j] = (int8_t)__builtin_lrintf(xo[j] * inv);
    }
    for (long q = g0 / 4; q < (g0 + half) / 4; q++) {
        int32_t c = 0;
        for (int j = 0; j < 4; j++)
            c += qe[4 * q + j] + qo[4 * q + j];
        corr[q] = -12 * c;
        xs_lane[q] = 0.5f * s;
    }
}

int sluice_q8_prep(const float *xe, const float *xo, long K2, int half, int8_t *qe, int8_t *qo, float *xs_lane,
                   int32_t *corr) {
    if (K2 % half || half % 4)
        return 0;  /* the int8 kernels take whole groups of whole quads only */
    for (long g0 = 0; g0 < K2; g0 += half)
        q8_group(xe, xo, g0, half, qe, qo, xs_lane, corr);
    return 1;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
/* 2 * E2M1 + 12 for the 16 codes, in each 128-bit lane (for vpshufb) */
static inline __m512i e2m1x2p12_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

/* 16 scale bytes (one per int32 lane) -> floats: E4M3 through fp16 bits (x 256), or E8M0 */
static inline __m512 scales16(__m128i b, int e8m0) {
    if (e8m0)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 23));
    return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_f16bits(_mm256_cvtepu8_epi16(b))), _mm512_set1_ps(256.0f));
}

/* n-major: y[n] = row n . x, K2 a multiple of 64. Per row, a run of up to Q8_SEG quads at a time: their weight-group
 * scales are decoded, spread to one per quad and multiplied by the quad's x scale before the run's steps, so a step
 * is a load, two table lookups, two vpdpbusd seeded with the correction, a conversion and one FMA per 64 bytes. */
#define Q8_SEG 1024

/* the constants of the int8 n-major rows: the weight table, the nibble mask, and the spread of a 16-group step's
 * scales to its quads (vector k of the step takes groups (16 k + lane) / per, per: quads of a scale group) */
typedef struct {
    __m512i table, low4, spread[4];
    long per;
} q8_consts;

static inline q8_consts q8_nconsts(int half) {
    q8_consts k;
    k.table = e2m1x2p12_table();
    k.low4 = _mm512_set1_epi8(15);
    k.per = half / 4;
    for (int v = 0; v < 4; v++) {
        int32_t idx[16];
        for (int l = 0; l < 16; l++)
            idx[l] = (16 * v + l) / (int)k.per;
        k.spread[v] = _mm512_loadu_si512(idx);
    }
    return k;
}

/* one n-major row (K2 bytes, its G = K2 / half scale bytes at srow) . x; sc: scratch [Q8_SEG] floats, 64-aligned */
static inline float q8_nrow(const q8_consts *k, const uint8_t *row, const uint8_t *srow, const int8_t *qe, const int8_t *qo,
                            const float *xs_lane, const int32_t *corr, long K2, long G, int e8m0, float *sc) {
    const long per = k->per;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    for (long c0 = 0; c0 < K2; c0 += 4 * Q8_SEG) {
        const long c1 = K2 - c0 < 4 * Q8_SEG ? K2 : c0 + 4 * Q8_SEG, q0 = c0 / 4, nq = (c1 - c0) / 4;
        for (long i = 0; i < nq; i += 16 * per) {  /* 16 groups' scales a step */
            const long g = (q0 + i) / per;
            __m128i b;  /* (a memcpy of a variable size here made the whole step twice as slow) */
            if (G - g >= 16)
                b = _mm_loadu_si128((const __m128i *)(srow + g));
            else {
                b = _mm_setzero_si128();
                memcpy(&b, srow + g, (size_t)(G - g));
            }
            const __m512 v = scales16(b, e8m0);
            for (int j = 0; j < per && i + 16 * j < nq; j++)
                _mm512_store_ps(sc + i + 16 * j,
                                _mm512_mul_ps(_mm512_permutexvar_ps(k->spread[j], v), _mm512_loadu_ps(xs_lane + q0 + i + 16 * j)));
        }
        long c = c0;
#define Q8_NSTEP(ACC, C)                                                                                              \
    do {                                                                                                              \
        __m512i b_ = _mm512_loadu_si512(row + (C));                                                                   \
        __m512i d_ = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + (C) / 4),                                          \
                                         _mm512_shuffle_epi8(k->table, _mm512_and_si512(b_, k->low4)), _mm512_loadu_si512(qe + (C))); \
        d_ = _mm512_dpbusd_epi32(d_, _mm512_shuffle_epi8(k->table, _mm512_and_si512(_mm512_srli_epi16(b_, 4), k->low4)), \
                                 _mm512_loadu_si512(qo + (C)));                                                       \
        ACC = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_), _mm512_load_ps(sc + ((C) - c0) / 4), ACC);                      \
    } while (0)
        for (; c + 128 <= c1; c += 128) {
            prefetch(row + c + PF_ROW);
            prefetch(row + c + PF_ROW + 64);
            Q8_NSTEP(acc0, c);
            Q8_NSTEP(acc1, c + 64);
        }
        if (c < c1) {
            prefetch(row + c + PF_ROW);
            Q8_NSTEP(acc0, c);
        }
#undef Q8_NSTEP
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* q8_nmajor's work for the calling thread of a parallel region (its `omp for` splits the rows) */
static void q8_nmajor_team(const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe, const int8_t *qo,
                           const float *xs_lane, const int32_t *corr, long N, long K2, int half, int e8m0, float *y) {
    float sc[Q8_SEG] __attribute__((aligned(64)));
    const q8_consts k = q8_nconsts(half);
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++)
        y[n] = q8_nrow(&k, p + n * K2, s + n * s_stride, qe, qo, xs_lane, corr, K2, K2 / half, e8m0, sc);
}

static void q8_nmajor(const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe, const int8_t *qo,
                      const float *xs_lane, const int32_t *corr, long N, long K2, int half, int e8m0, float *y) {
#pragma omp parallel
    q8_nmajor_team(p, s, s_stride, qe, qo, xs_lane, corr, N, K2, half, e8m0, y);
}

/* k-major (re-laid down, [K2, N] bytes, scales [K2 / half, N]): y[n] = column n . x. Each thread a run of scale
 * groups; per group, 4 rows at a time are interleaved into int32 lanes of (r0, r1, r2, r3) bytes per output (in a
 * fixed permutation of each 64 outputs, undone once at the end) and summed by vpdpbusd; the group's int32 sums
 * are then scaled into the thread's fp32 sums (all N in L1), added across threads at the end. N a multiple of 64. */

/* scale bytes of a 64-output chunk into the k-major step's output order (below) */
static inline __m512i q8_sperm(void) {
    return _mm512_set_epi8(
        63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12, 59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24,
        11, 10, 9, 8, 55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4, 51, 50, 49, 48, 35, 34, 33, 32, 19, 18,
        17, 16, 3, 2, 1, 0);
}

/* one k-major scale group (rows k0 .. k0 + half of p, [K2, N] bytes; its N scale bytes at sr) added into acc [N], in
 * the permuted order of each 64 outputs */
static inline void q8_kgroup(float *acc, const uint8_t *p, const uint8_t *sr, const int8_t *qe, const int8_t *qo,
                             const float *xs_lane, const int32_t *corr, long N, long k0, int half, int e8m0) {
    const __m512i table = e2m1x2p12_table(), low4 = _mm512_set1_epi8(15), sperm = q8_sperm();
    int32_t cg = 0;
    for (long q = k0 / 4; q < (k0 + half) / 4; q++)
        cg += corr[q];
    const __m512i cv = _mm512_set1_epi32(cg);
    const __m512 xs = _mm512_set1_ps(xs_lane[k0 / 4]);
    for (long n0 = 0; n0 < N; n0 += 64) {
        __m512i d0 = _mm512_setzero_si512(), d1 = d0, d2 = d0, d3 = d0;
        for (long k = k0; k < k0 + half; k += 4) {
            const uint8_t *r = p + k * N + n0;
            prefetch(r + PF_KROW);
            prefetch(r + N + PF_KROW);
            prefetch(r + 2 * N + PF_KROW);
            prefetch(r + 3 * N + PF_KROW);
            __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + N);
            __m512i r2 = _mm512_loadu_si512(r + 2 * N), r3 = _mm512_loadu_si512(r + 3 * N);
            __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
            __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
            __m512i xe4 = _mm512_set1_epi32(*(const int32_t *)(qe + k)), xo4 = _mm512_set1_epi32(*(const int32_t *)(qo + k));
#define Q8_STEP(D, V)                                                                                               \
    do {                                                                                                            \
        __m512i v_ = (V);                                                                                           \
        D = _mm512_dpbusd_epi32(D, _mm512_shuffle_epi8(table, _mm512_and_si512(v_, low4)), xe4);                   \
        D = _mm512_dpbusd_epi32(D, _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v_, 4), low4)), xo4); \
    } while (0)
            Q8_STEP(d0, _mm512_unpacklo_epi16(t0, t2));
            Q8_STEP(d1, _mm512_unpackhi_epi16(t0, t2));
            Q8_STEP(d2, _mm512_unpacklo_epi16(t1, t3));
            Q8_STEP(d3, _mm512_unpackhi_epi16(t1, t3));
#undef Q8_STEP
        }
        /* lane 4b + j of d_i is output n0 + 16 b + 4 i + j: the sums stay in this order (acc[n0 + 16 i + 4 b + j])
         * until the end; the group's scales are permuted to match */
        __m512i sb = _mm512_permutexvar_epi8(sperm, _mm512_loadu_si512(sr + n0));
        __m512i dv[4] = {d0, d1, d2, d3};
        for (int i = 0; i < 4; i++) {
            __m512 sv = _mm512_mul_ps(scales16(_mm512_extracti32x4_epi32(sb, 0), e8m0), xs);
            sb = _mm512_alignr_epi32(sb, sb, 4);
            float *a = acc + n0 + 16 * i;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dv[i], cv)), sv, _mm512_loadu_ps(a)));
        }
    }
}

/* the sum of `parts` permuted k-major partial sums [N] (64-output chunk n0), times factor, into y in output order */
static inline void q8_kunpermute(float *const *parts, int nparts, long n0, float factor, float *y) {
    float sum[64];
    for (int m = 0; m < 64; m += 16) {
        __m512 v = _mm512_loadu_ps(parts[0] + n0 + m);
        for (int t = 1; t < nparts; t++)
            v = _mm512_add_ps(v, _mm512_loadu_ps(parts[t] + n0 + m));
        _mm512_storeu_ps(sum + m, factor == 1.0f ? v : _mm512_mul_ps(v, _mm512_set1_ps(factor)));
    }
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 4; b++)
            for (int j = 0; j < 4; j++)
                y[n0 + 16 * b + 4 * i + j] = sum[16 * i + 4 * b + j];
}

/* q8_kmajor's work for the calling thread of a parallel region: its run of groups into buf (sized by team_buf for the
 * team), a barrier, then its share of the outputs summed over the team's threads. */
static void q8_kmajor_team(float *buf, const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe, const int8_t *qo,
                           const float *xs_lane, const int32_t *corr, long N, long K2, int half, int e8m0, float *y) {
    long G = K2 / half;
    const int used = omp_get_num_threads();
    const int t = omp_get_thread_num();
    float *acc = buf + 2L * t * N;
    for (long n = 0; n < N; n++)
        acc[n] = 0.0f;
    for (long g = G * t / used; g < G * (t + 1) / used; g++)
        q8_kgroup(acc, p, s + g * s_stride, qe, qo, xs_lane, corr, N, g * half, half, e8m0);
#pragma omp barrier
    float *parts[used];
    for (int u = 0; u < used; u++)
        parts[u] = buf + 2L * u * N;
#pragma omp for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64)  /* the threads' sums added and put in output order */
        q8_kunpermute(parts, used, n0, 1.0f, y);
}

static int q8_kmajor(const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe, const int8_t *qo,
                     const float *xs_lane, const int32_t *corr, long N, long K2, int half, int e8m0, float *y) {
    int T = omp_get_max_threads();
    float *buf = team_buf(T, N);
    if (!buf)
        return 0;
#pragma omp parallel num_threads(T)
    q8_kmajor_team(buf, p, s, s_stride, qe, qo, xs_lane, corr, N, K2, half, e8m0, y);
    return 1;
}
#endif

/* int8-activation FP4 matvec: 1 if it ran (AVX-512 VNNI and fitting sizes), else 0 (the caller uses the fp32 one) */
int sluice_fp4_q8(const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe, const int8_t *qo, const float *xs_lane,
                  const int32_t *corr, long N, long K2, int half, int e8m0, int kmajor, float *y) {
    init_scales();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
    if (!kmajor && K2 % 64 == 0) {
        q8_nmajor(p, s, s_stride, qe, qo, xs_lane, corr, N, K2, half, e8m0, y);
        return 1;
    }
    if (kmajor && N % 64 == 0 && K2 % half == 0 && half % 4 == 0)
        return q8_kmajor(p, s, s_stride, qe, qo, xs_lane, corr, N, K2, half, e8m0, y);
#endif
    (void)p; (void)s; (void)s_stride; (void)qe; (void)qo; (void)xs_lane; (void)corr; (void)N; (void)K2; (void)half; (void)e8m0;
    (void)kmajor; (void)y;
    return 0;
}
