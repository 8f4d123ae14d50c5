/* FP4 (NVFP4 / MXFP4), FP8 and BF16 matvecs on the CPU over a block's stored bytes: kernels/cpu.py's native path.
 * (FP8 and BF16 below the FP4 kernels; then FP4 with int8 activations through AVX-512 VNNI.)
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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* E2M1 code -> value: a 16-entry table in L1 (arithmetic decodes compile to branches that random
 * codes mispredict, ~20 x slower) */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
#define e2m1(c) E2M1[(c)]

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float scale_decode(uint8_t b, int e8m0) {
    if (e8m0)
        return bits_f32((uint32_t)b << 23);
    uint32_t e = (b >> 3) & 15, m = b & 7;
    if (e == 0)
        return (b & 128 ? -1.0f : 1.0f) * (float)m * (1.0f / 512);
    return bits_f32(((uint32_t)(b & 128) << 24) | ((e + 120) << 23) | (m << 20));
}

/* every scale byte's value, per kind (E4M3, E8M0): a table lookup instead of a branchy decode per
 * group (a re-laid down decodes one scale per output per group: ~300k per Nano expert) */
static float SCALES[2][256];
static int scales_ready;

static void init_scales(void) {
    if (scales_ready)
        return;
    for (int k = 0; k < 2; k++)
        for (int b = 0; b < 256; b++)
            SCALES[k][b] = scale_decode((uint8_t)b, k);
    __atomic_store_n(&scales_ready, 1, __ATOMIC_RELEASE);
}

#define scale_f32(b, e8m0) SCALES[(e8m0) != 0][(b)]

/* Software prefetch distances (bytes ahead in a stream): the GPU machine's Xeon keeps too few of one core's
 * reads in flight while it decodes (a core's kernels read at half its plain read rate without them;
 * BENCHMARKS.md, tenth session). Prefetches never fault, so reaching past a buffer's end is harmless. */
#define PF_ROW 2048  /* n-major: along the thread's run of rows (contiguous) */
#define PF_KROW 256  /* k-major: along each of the rows read side by side */
#define PF_KSTEP 8   /* k-major by column chunks: rows ahead of the one read */
#define prefetch(p) __builtin_prefetch((p), 0, 3)


/* the rows one grab of a dynamic `omp for` takes: eight grabs a thread, so a thread the host slows (a neighbour, a
 * busy core) does fewer rows rather than holding the call (the GPU machine's calls ran ~1.7 x slower in some runs) */
static inline long team_chunk(long items, int T) {
    const long c = items / (8L * T);
    return c > 1 ? c : 1;
}

/* the runs a team of T splits G k-major scale groups into: four a thread, taken as threads come free (team_chunk's
 * reason); each run sums into buffers of its own, added in run order, so a result depends on T, not on who ran what */
static inline long team_runs(long G, int T) { return G < 4L * T ? G : 4L * T; }

/* run u of R over G groups: its sums (buf + u * N) zeroed and returned, its groups [*g0, *g1) */
static inline float *team_run(float *buf, long u, long R, long G, long N, long *g0, long *g1) {
    float *acc = buf + u * N;
    memset(acc, 0, sizeof(float) * (size_t)N);
    *g0 = G * u / R;
    *g1 = G * (u + 1) / R;
    return acc;
}

void sluice_set_threads(int n) {
    init_scales();
    if (n > 0)
        omp_set_num_threads(n);
}

#ifdef __AVX2__
#include <immintrin.h>

/* 2 x E2M1 values of 16 codes as int8 (0, 1, 2, 3, 4, 6, 8, 12 and negatives), for pshufb */
static inline __m128i e2m1x2_table(void) {
    return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

/* 8 int8 lanes (the low 8 bytes of v) -> 8 floats */
static inline __m256 i8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* dot of 8 packed bytes (16 codes: lo = even inputs) with xe[0..8), xo[0..8), as 8 lanes (x 2: the table doubles) */
static inline __m256 dot8(__m128i bytes, const float *xe, const float *xo, __m128i table, __m128i low4) {
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    return _mm256_fmadd_ps(i8_ps(hi), _mm256_loadu_ps(xo), _mm256_mul_ps(i8_ps(lo), _mm256_loadu_ps(xe)));
}

#ifdef __AVX512BW__
/* 16 int8 lanes -> 16 floats */
static inline __m512 i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* one n-major FP4 row (K2 bytes, its group scales at srow) . x, x given as its even and odd elements */
static inline float fp4_row(const uint8_t *row, const uint8_t *srow, const float *xe, const float *xo, long K2, int half,
                            int e8m0) {
    float acc = 0.0f;
    long g0 = 0, g = 0;
#if defined(__AVX512BW__)
    {  /* 16 bytes (32 codes, one or two scale groups) a step; codes looked up as floats by permutes */
        const __m512 table = _mm512_loadu_ps(E2M1);
        const float *lut = SCALES[e8m0 != 0];
        __m512 vacc = _mm512_setzero_ps();
        for (; g0 + 16 <= K2; g0 += 16) {
            if (!(g0 & 63))
                prefetch(row + g0 + PF_ROW);
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + g0)));
            __m512 lo = _mm512_permutexvar_ps(c, table), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table);
            __m512 t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + g0), _mm512_mul_ps(lo, _mm512_loadu_ps(xe + g0)));
            __m512 sv = half == 16 ? _mm512_set1_ps(lut[srow[g0 / 16]])
                                   : _mm512_insertf32x8(_mm512_set1_ps(lut[srow[g0 / 8]]), _mm256_set1_ps(lut[srow[g0 / 8 + 1]]), 1);
            vacc = _mm512_fmadd_ps(t, sv, vacc);
        }
        g = g0 / half;
        acc = _mm512_reduce_add_ps(vacc);
    }
#elif defined(__AVX2__)
    {
        const __m128i table = e2m1x2_table(), low4 = _mm_set1_epi8(15);
        __m256 vacc = _mm256_setzero_ps();
        float sc[512];  /* the row's group scales, decoded up front (x 0.5: the table holds 2 x E2M1) */
        long G = K2 / half < 512 ? K2 / half : 512;
        for (long i = 0; i < G; i++)
            sc[i] = 0.5f * scale_f32(srow[i], e8m0);
        for (; g0 + half <= K2 && g < G; g0 += half, g++) {  /* whole groups of 8 or 16 bytes */
            __m256 scale = _mm256_set1_ps(sc[g]);
            for (long j = g0; j < g0 + half; j += 8) {
                __m128i bytes = _mm_loadl_epi64((const __m128i *)(row + j));
                vacc = _mm256_fmadd_ps(dot8(bytes, xe + j, xo + j, table, low4), scale, vacc);
            }
        }
        acc = hsum(vacc);
    }
#endif
    for (; g0 < K2; g0 += half, g++) {
        long end = g0 + half < K2 ? g0 + half : K2;
        float part = 0.0f;
        for (long j = g0; j < end; j++) {
            int b = row[j];
            part += e2m1(b & 15) * xe[j] + e2m1(b >> 4) * xo[j];
        }
        acc += part * scale_f32(srow[g], e8m0);
    }
    return acc;
}

void sluice_fp4_nmajor(const uint8_t *p, const uint8_t *s, long s_stride, const float *xe, const float *xo,
                       long N, long K2, int half, int e8m0, float *y) {
    init_scales();
#pragma omp parallel for schedule(dynamic, team_chunk(N, omp_get_max_threads()))
    for (long n = 0; n < N; n++)
        y[n] = fp4_row(p + n * K2, s + n * s_stride, xe, xo, K2, half, e8m0);
}

#define CHUNK 256

/* E4M3 bytes -> floats / 256, vectorised: sign to bit 15 and exponent + mantissa to bits 7-14 make an
 * fp16 of the same value / 2**8 (biases 7 and 15; subnormals too), converted by vcvtph2ps. The byte shifted
 * left by 7 puts the sign at bit 14; adding that bit to itself carries it to bit 15 and clears bit 14. */
#ifdef __AVX512F__
static inline __m256i e4m3_f16bits(__m256i h) {
    __m256i f = _mm256_slli_epi16(h, 7);
    return _mm256_add_epi16(f, _mm256_and_si256(f, _mm256_set1_epi16(0x4000)));
}

static inline __m512 e4m3x16(const uint8_t *p) {
    return _mm512_cvtph_ps(e4m3_f16bits(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p))));
}
#elif defined(__AVX2__) && defined(__F16C__)
static inline __m256 e4m3x8(const uint8_t *p) {
    __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i f = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(f);
}
#endif


#ifdef __AVX512BW__
#include <stdlib.h>

/* per calling thread: the OpenMP team's partial sums and accumulators */
static __thread float *rows_buf;
static __thread long rows_cap;

/* the calling thread's rows_buf, at least `need` floats, or NULL when it cannot be had (the team's threads see their
 * own rows_buf: pass them this pointer) */
static float *team_buf(long need) {
    if (need > rows_cap) {
        free(rows_buf);
        rows_buf = aligned_alloc(64, (size_t)need * sizeof(float));
        rows_cap = rows_buf ? need : 0;
    }
    return rows_buf;
}

/* one k-major FP4 scale group (rows j .. end of p, [K2, N] bytes; its N scale bytes at sr) added into acc [N]:
 * part [N] is scratch. N a multiple of 16. */
static inline void fp4_kgroup(float *acc, float *part, const uint8_t *p, const uint8_t *sr, const float *xe, const float *xo,
                              long N, long j, long end, int e8m0) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    for (long n = 0; n < N; n++)
        part[n] = 0.0f;
    for (; j + 1 < end; j += 2) {  /* two rows a pass: each output's partial sum loaded and stored once */
        const uint8_t *r0 = p + j * N, *r1 = r0 + N;
        const __m512 a0 = _mm512_set1_ps(xe[j]), b0 = _mm512_set1_ps(xo[j]);
        const __m512 a1 = _mm512_set1_ps(xe[j + 1]), b1 = _mm512_set1_ps(xo[j + 1]);
        for (long n = 0; n < N; n += 16) {
            if (!(n & 63)) {
                prefetch(r0 + n + PF_KROW);
                prefetch(r1 + n + PF_KROW);
            }
            __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + n)));
            __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r1 + n)));
            __m512 v = _mm512_loadu_ps(part + n);
            v = _mm512_fmadd_ps(_mm512_permutexvar_ps(c0, table), a0, v);
            v = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table), b0, v);
            v = _mm512_fmadd_ps(_mm512_permutexvar_ps(c1, table), a1, v);
            v = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), table), b1, v);
            _mm512_storeu_ps(part + n, v);
        }
    }
    for (; j < end; j++) {
        const uint8_t *r0 = p + j * N;
        const __m512 a0 = _mm512_set1_ps(xe[j]), b0 = _mm512_set1_ps(xo[j]);
        for (long n = 0; n < N; n += 16) {
            __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + n)));
            __m512 v = _mm512_loadu_ps(part + n);
            v = _mm512_fmadd_ps(_mm512_permutexvar_ps(c0, table), a0, v);
            v = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table), b0, v);
            _mm512_storeu_ps(part + n, v);
        }
    }
    for (long n = 0; n < N; n += 16) {  /* the group's scales, 16 bytes decoded in registers */
        __m128i b = _mm_loadu_si128((const __m128i *)(sr + n));
        __m512 sv = e8m0 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 23))
                         : _mm512_mul_ps(e4m3x16(sr + n), _mm512_set1_ps(256.0f));
        _mm512_storeu_ps(acc + n, _mm512_fmadd_ps(_mm512_loadu_ps(part + n), sv, _mm512_loadu_ps(acc + n)));
    }
}

/* k-major by rows: the scale groups in team_runs' runs, each taken by whichever thread is free, its rows streamed
 * whole (contiguous bytes, where the 64-output chunks above read 64 bytes a row at a stride of N), all N outputs'
 * partial sums in L1 (part, per group and thread) and the run's own running sums (acc); the runs' sums are added in
 * run order at the end, so the outputs do not depend on which thread took which run. N a multiple of 16. */
static int kmajor_rows(const uint8_t *p, const uint8_t *s, long s_stride, const float *xe, const float *xo,
                       long N, long K2, int half, int e8m0, float *y) {
    const int T = omp_get_max_threads();
    const long G = (K2 + half - 1) / half, R = team_runs(G, T);
    float *buf = team_buf((R + T) * N);  /* each run's sums, then each thread's scratch */
    if (!buf)
        return 0;
#pragma omp parallel num_threads(T)
    {
        float *part = buf + (R + omp_get_thread_num()) * N;
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < R; u++) {
            long g0, g1;
            float *acc = team_run(buf, u, R, G, N, &g0, &g1);
            for (long g = g0; g < g1; g++)
                fp4_kgroup(acc, part, p, s + g * s_stride, xe, xo, N, g * half, g * half + half < K2 ? g * half + half : K2, e8m0);
        }
    }
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n += 16) {
        __m512 v = _mm512_loadu_ps(buf + n);
        for (long u = 1; u < R; u++)
            v = _mm512_add_ps(v, _mm512_loadu_ps(buf + u * N + n));
        _mm512_storeu_ps(y + n, v);
    }
    return 1;
}
#endif

void sluice_fp4_kmajor(const uint8_t *p, const uint8_t *s, long s_stride, const float *xe, const float *xo,
                       long N, long K2, int half, int e8m0, float *y) {
    init_scales();
#ifdef __AVX512BW__
    if (N % 16 == 0 && kmajor_rows(p, s, s_stride, xe, xo, N, K2, half, e8m0, y))
        return;
#endif
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += CHUNK) {
        long w = N - n0 < CHUNK ? N - n0 : CHUNK;
        float acc[CHUNK], part[CHUNK];
        for (long i = 0; i < w; i++)
            acc[i] = 0.0f;
        for (long g0 = 0, g = 0; g0 < K2; g0 += half, g++) {
            long end = g0 + half < K2 ? g0 + half : K2;
            for (long i = 0; i < w; i++)
                part[i] = 0.0f;
            for (long j = g0; j < end; j++) {
                const uint8_t *r = p + j * N + n0;
                float a = xe[j], b = xo[j];
                long i = 0;
#ifdef __AVX2__
                const __m128i table = e2m1x2_table(), low4 = _mm_set1_epi8(15);
                const __m256 va = _mm256_set1_ps(0.5f * a), vb = _mm256_set1_ps(0.5f * b);
                for (; i + 8 <= w; i += 8) {  /* 8 outputs: their codes in 8 bytes of this input row */
                    __m128i bytes = _mm_loadl_epi64((const __m128i *)(r + i));
                    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
                    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
                    __m256 v = _mm256_loadu_ps(part + i);
                    v = _mm256_fmadd_ps(i8_ps(lo), va, v);
                    _mm256_storeu_ps(part + i, _mm256_fmadd_ps(i8_ps(hi), vb, v));
                }
#endif
                for (; i < w; i++) {
                    int c = r[i];
                    part[i] += e2m1(c & 15) * a + e2m1(c >> 4) * b;
                }
            }
            const uint8_t *sr = s + g * s_stride + n0;
            for (long i = 0; i < w; i++)
                acc[i] += part[i] * scale_f32(sr[i], e8m0);
        }
        for (long i = 0; i < w; i++)
            y[n0 + i] = acc[i];
    }
}

/* ---- FP8 (E4M3) matvec: weights [N, K] (n-major) or a re-laid down [K, N] (k-major), bytes as stored.
 * Block scales (s != NULL): one per block x block tile, in the weight's orientation, F32 or E8M0, row
 * stride s_stride (elements); without them (per-tensor / per-row FP8) the caller scales y. x [K], y [N]. */

static inline float block_scale(const uint8_t *s, long idx, int e8m0) {
    return e8m0 ? SCALES[1][s[idx]] : ((const float *)s)[idx];
}


/* row n of an n-major E4M3 weight [N, K] (w: the row) . x, each block of B inputs scaled by its block scale (s: none
 * when the caller scales the whole row) */
static inline float fp8_row(const uint8_t *row, const uint8_t *s, long s_stride, long block, int e8m0, const float *x, long n,
                            long K) {
    const long B = s ? block : K;
    float acc = 0.0f;
    for (long k0 = 0, kb = 0; k0 < K; k0 += B, kb++) {
        long end = k0 + B < K ? k0 + B : K, k = k0;
        float part = 0.0f;
#ifdef __AVX512F__
        __m512 v = _mm512_setzero_ps();
        for (; k + 16 <= end; k += 16) {
            if (!(k & 63))
                prefetch(row + k + PF_ROW);
            v = _mm512_fmadd_ps(e4m3x16(row + k), _mm512_loadu_ps(x + k), v);
        }
        part = 256.0f * _mm512_reduce_add_ps(v);
#elif defined(__AVX2__) && defined(__F16C__)
        __m256 v = _mm256_setzero_ps();
        for (; k + 8 <= end; k += 8)
            v = _mm256_fmadd_ps(e4m3x8(row + k), _mm256_loadu_ps(x + k), v);
        part = 256.0f * hsum(v);
#endif
        for (; k < end; k++)
            part += SCALES[0][row[k]] * x[k];
        acc += s ? part * block_scale(s, (n / block) * s_stride + kb, e8m0) : part;
    }
    return acc;
}

/* outputs n0 .. n0 + 64 (fewer at the edge) of a k-major E4M3 weight [K, N] . x into y[n0 ..] */
static inline void fp8_chunk(const uint8_t *w, const uint8_t *s, long s_stride, long block, int e8m0, const float *x, long N,
                             long K, long n0, float *y) {
    const long B = s ? block : K;
    long wd = N - n0 < 64 ? N - n0 : 64;
    float acc[64], part[64];
    for (long i = 0; i < wd; i++)
        acc[i] = 0.0f;
    for (long k0 = 0, kb = 0; k0 < K; k0 += B, kb++) {
        long end = k0 + B < K ? k0 + B : K;
#ifdef __AVX512F__
        if (wd == 64) {  /* 64 outputs' sums in four registers while the block's rows stream by */
            __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
            for (long k = k0; k < end; k++) {
                const uint8_t *r = w + k * N + n0;
                prefetch(r + PF_KSTEP * N);
                const __m512 xk = _mm512_set1_ps(256.0f * x[k]);
                p0 = _mm512_fmadd_ps(e4m3x16(r), xk, p0);
                p1 = _mm512_fmadd_ps(e4m3x16(r + 16), xk, p1);
                p2 = _mm512_fmadd_ps(e4m3x16(r + 32), xk, p2);
                p3 = _mm512_fmadd_ps(e4m3x16(r + 48), xk, p3);
            }
            _mm512_storeu_ps(part, p0);
            _mm512_storeu_ps(part + 16, p1);
            _mm512_storeu_ps(part + 32, p2);
            _mm512_storeu_ps(part + 48, p3);
        } else
#endif
        {
            for (long i = 0; i < wd; i++)
                part[i] = 0.0f;
            for (long k = k0; k < end; k++) {
                const uint8_t *r = w + k * N + n0;
                long i = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
                const __m256 xk = _mm256_set1_ps(256.0f * x[k]);
                for (; i + 8 <= wd; i += 8)
                    _mm256_storeu_ps(part + i, _mm256_fmadd_ps(e4m3x8(r + i), xk, _mm256_loadu_ps(part + i)));
#endif
                for (; i < wd; i++)
                    part[i] += SCALES[0][r[i]] * x[k];
            }
        }
        for (long i = 0; i < wd; i++)
            acc[i] += s ? part[i] * block_scale(s, kb * s_stride + (n0 + i) / block, e8m0) : part[i];
    }
    for (long i = 0; i < wd; i++)
        y[n0 + i] = acc[i];
}

void sluice_fp8_nmajor(const uint8_t *w, const uint8_t *s, long s_stride, long block, int e8m0, const float *x,
                       long N, long K, float *y) {
    init_scales();
#pragma omp parallel for schedule(dynamic, team_chunk(N, omp_get_max_threads()))
    for (long n = 0; n < N; n++)
        y[n] = fp8_row(w + n * K, s, s_stride, block, e8m0, x, n, K);
}

void sluice_fp8_kmajor(const uint8_t *w, const uint8_t *s, long s_stride, long block, int e8m0, const float *x,
                       long N, long K, float *y) {
    init_scales();
#pragma omp parallel for schedule(dynamic, 1)
    for (long n0 = 0; n0 < N; n0 += 64)
        fp8_chunk(w, s, s_stride, block, e8m0, x, N, K, n0, y);
}

/* he[i], ho[i] = relu(s2 * h[2i])^2, relu(s2 * h[2i+1])^2 for i in [i0, i1): a ReLU^2 expert's activation, split into the
 * down projection's even and odd inputs (NaN stays NaN, as torch's relu keeps it) */
static inline void relu2_pairs(const float *h, float s2, long i0, long i1, float *he, float *ho) {
    for (long i = i0; i < i1; i++) {
        float a = h[2 * i] * s2, b = h[2 * i + 1] * s2;
        a = a > 0.0f || a != a ? a : 0.0f;
        b = b > 0.0f || b != b ? b : 0.0f;
        he[i] = a * a;
        ho[i] = b * b;
    }
}

/* A ReLU^2 expert in one call: FP4 `up` [I, Dx/2] n-major, FP4 `down` re-laid k-major [I/2, Dx];
 * y = down_s2 * down(relu(up_s2 * up(x))^2), the arithmetic of the two matvecs with the activation
 * between them in kernels/cpu.py, with the GIL released for the whole expert rather than taken back
 * between the steps. h: scratch [I]; he, ho: scratch [I/2]. */
void sluice_fp4_relu2_expert(const uint8_t *up, const uint8_t *up_s, long up_s_stride, float up_s2,
                             const uint8_t *down, const uint8_t *down_s, long down_s_stride, float down_s2,
                             const float *xe, const float *xo, long Dx, long I, int half, int e8m0,
                             float *h, float *he, float *ho, float *y) {
    sluice_fp4_nmajor(up, up_s, up_s_stride, xe, xo, I, Dx / 2, half, e8m0, h);
    relu2_pairs(h, up_s2, 0, I / 2, he, ho);
    sluice_fp4_kmajor(down, down_s, down_s_stride, he, ho, Dx, I / 2, half, e8m0, y);
    for (long n = 0; n < Dx; n++)
        y[n] *= down_s2;
}

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
#pragma omp for schedule(dynamic, team_chunk(N, omp_get_num_threads()))
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

/* q8_kmajor's work for the calling thread of a parallel region: runs of groups (R of them, team_runs) into buf [R, N],
 * each run to whichever thread is free, then a share of the outputs summed over the runs in run order. */
static void q8_kmajor_team(float *buf, long R, const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe,
                           const int8_t *qo, const float *xs_lane, const int32_t *corr, long N, long K2, int half, int e8m0,
                           float *y) {
    const long G = K2 / half;
#pragma omp for schedule(dynamic, 1)
    for (long u = 0; u < R; u++) {
        long g0, g1;
        float *acc = team_run(buf, u, R, G, N, &g0, &g1);
        for (long g = g0; g < g1; g++)
            q8_kgroup(acc, p, s + g * s_stride, qe, qo, xs_lane, corr, N, g * half, half, e8m0);
    }
    float *parts[R];
    for (long u = 0; u < R; u++)
        parts[u] = buf + u * N;
#pragma omp for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64)  /* the runs' sums added and put in output order */
        q8_kunpermute(parts, (int)R, n0, 1.0f, y);
}

static int q8_kmajor(const uint8_t *p, const uint8_t *s, long s_stride, const int8_t *qe, const int8_t *qo,
                     const float *xs_lane, const int32_t *corr, long N, long K2, int half, int e8m0, float *y) {
    const int T = omp_get_max_threads();
    const long R = team_runs(K2 / half, T);
    float *buf = team_buf(R * N);
    if (!buf)
        return 0;
#pragma omp parallel num_threads(T)
    q8_kmajor_team(buf, R, p, s, s_stride, qe, qo, xs_lane, corr, N, K2, half, e8m0, y);
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

/* sluice_fp4_relu2_expert with int8 activations (x, then relu(up)^2, quantized per scale group, sluice_q8_prep), each
 * matvec falling back to the fp32 kernel where the int8 one does not run. Scratch: q [2 * M] int8, xs, c [M / 4] with
 * M = max(Dx, I) / 2. */
void sluice_fp4_relu2_expert_q8(const uint8_t *up, const uint8_t *up_s, long up_s_stride, float up_s2,
                                const uint8_t *down, const uint8_t *down_s, long down_s_stride, float down_s2,
                                const float *xe, const float *xo, long Dx, long I, int half, int e8m0,
                                float *h, float *he, float *ho, float *y, int8_t *q, float *xs, int32_t *c) {
    long M = (Dx > I ? Dx : I) / 2;
    init_scales();
    if (!sluice_q8_prep(xe, xo, Dx / 2, half, q, q + M, xs, c) ||
        !sluice_fp4_q8(up, up_s, up_s_stride, q, q + M, xs, c, I, Dx / 2, half, e8m0, 0, h))
        sluice_fp4_nmajor(up, up_s, up_s_stride, xe, xo, I, Dx / 2, half, e8m0, h);
    relu2_pairs(h, up_s2, 0, I / 2, he, ho);
    if (!sluice_q8_prep(he, ho, I / 2, half, q, q + M, xs, c) ||
        !sluice_fp4_q8(down, down_s, down_s_stride, q, q + M, xs, c, Dx, I / 2, half, e8m0, 1, y))
        sluice_fp4_kmajor(down, down_s, down_s_stride, he, ho, Dx, I / 2, half, e8m0, y);
    for (long n = 0; n < Dx; n++)
        y[n] *= down_s2;
}

/* ---- BF16 matvec: weights [N, K] (n-major) or a re-laid down [K, N] (k-major), bf16 bits widened to fp32 in
 * registers (a shift), fp32 FMAs: the torch path's arithmetic up to summation order. x [K], y [N]. */

#ifdef __AVX512F__
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

static inline float bf16_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

/* a row of an n-major BF16 weight [N, K] . x */
static inline float bf16_row(const uint16_t *row, const float *x, long K) {
    long k = 0;
    float acc = 0.0f;
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (; k + 32 <= K; k += 32) {
        prefetch((const char *)(row + k) + PF_ROW);
        a0 = _mm512_fmadd_ps(bf16x16(row + k), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(bf16x16(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    }
    acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
    for (; k < K; k++)
        acc += bf16_f32(row[k]) * x[k];
    return acc;
}

/* outputs n0 .. n0 + 64 (fewer at the edge) of a k-major BF16 weight [K, N] . x into y[n0 ..] */
static inline void bf16_chunk(const uint16_t *w, const float *x, long N, long K, long n0, float *y) {
    long wd = N - n0 < 64 ? N - n0 : 64;
    float part[64];
    for (long i = 0; i < wd; i++)
        part[i] = 0.0f;
#ifdef __AVX512F__
    if (wd == 64) {  /* 64 outputs' sums in four registers while the rows stream by */
        __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
        for (long k = 0; k < K; k++) {
            const uint16_t *r = w + k * N + n0;
            prefetch(r + PF_KSTEP * N);
            prefetch(r + PF_KSTEP * N + 32);
            const __m512 xk = _mm512_set1_ps(x[k]);
            p0 = _mm512_fmadd_ps(bf16x16(r), xk, p0);
            p1 = _mm512_fmadd_ps(bf16x16(r + 16), xk, p1);
            p2 = _mm512_fmadd_ps(bf16x16(r + 32), xk, p2);
            p3 = _mm512_fmadd_ps(bf16x16(r + 48), xk, p3);
        }
        _mm512_storeu_ps(part, p0);
        _mm512_storeu_ps(part + 16, p1);
        _mm512_storeu_ps(part + 32, p2);
        _mm512_storeu_ps(part + 48, p3);
    } else
#endif
    {
        for (long k = 0; k < K; k++)
            for (long i = 0; i < wd; i++)
                part[i] += bf16_f32(w[k * N + n0 + i]) * x[k];
    }
    for (long i = 0; i < wd; i++)
        y[n0 + i] = part[i];
}

void sluice_bf16_nmajor(const uint16_t *w, const float *x, long N, long K, float *y) {
#pragma omp parallel for schedule(dynamic, team_chunk(N, omp_get_max_threads()))
    for (long n = 0; n < N; n++)
        y[n] = bf16_row(w + n * K, x, K);
}

void sluice_bf16_kmajor(const uint16_t *w, const float *x, long N, long K, float *y) {
#pragma omp parallel for schedule(dynamic, 1)
    for (long n0 = 0; n0 < N; n0 += 64)
        bf16_chunk(w, x, N, K, n0, y);
}

/* A SwiGLU FP4 expert in one call: y = down_s2 * down(silu(g) * u), g = gate_s2 * gate(x), u = up_s2 * up(x); gate,
 * up [I, Dx/2] and down [Dx, I/2] n-major. int8: x and the gated unit's output rounded per scale group (as in
 * sluice_fp4_relu2_expert_q8), each matvec falling back to fp32 where the int8 kernel does not run. Scratch: g, u [I],
 * he, ho [I/2]; q [2 M] int8, xs, c [M / 4] with M = max(Dx, I) / 2. */
void sluice_fp4_swiglu_expert(const uint8_t *gate, const uint8_t *gate_s, long gate_s_stride, float gate_s2,
                              const uint8_t *up, const uint8_t *up_s, long up_s_stride, float up_s2,
                              const uint8_t *down, const uint8_t *down_s, long down_s_stride, float down_s2,
                              const float *xe, const float *xo, long Dx, long I, int half, int e8m0, float *g, float *u,
                              float *he, float *ho, float *y, int8_t *q, float *xs, int32_t *c, int int8) {
    long M = (Dx > I ? Dx : I) / 2;
    int q8 = int8 && sluice_q8_prep(xe, xo, Dx / 2, half, q, q + M, xs, c);
    if (!q8 || !sluice_fp4_q8(gate, gate_s, gate_s_stride, q, q + M, xs, c, I, Dx / 2, half, e8m0, 0, g))
        sluice_fp4_nmajor(gate, gate_s, gate_s_stride, xe, xo, I, Dx / 2, half, e8m0, g);
    if (!q8 || !sluice_fp4_q8(up, up_s, up_s_stride, q, q + M, xs, c, I, Dx / 2, half, e8m0, 0, u))
        sluice_fp4_nmajor(up, up_s, up_s_stride, xe, xo, I, Dx / 2, half, e8m0, u);
    for (long i = 0; i < I; i++) {
        float a = g[i] * gate_s2, b = u[i] * up_s2;
        float h = a / (1.0f + __builtin_expf(-a)) * b;
        if (i % 2)
            ho[i / 2] = h;
        else
            he[i / 2] = h;
    }
    q8 = int8 && sluice_q8_prep(he, ho, I / 2, half, q, q + M, xs, c);
    if (!q8 || !sluice_fp4_q8(down, down_s, down_s_stride, q, q + M, xs, c, Dx, I / 2, half, e8m0, 0, y))
        sluice_fp4_nmajor(down, down_s, down_s_stride, he, ho, Dx, I / 2, half, e8m0, y);
    for (long n = 0; n < Dx; n++)
        y[n] *= down_s2;
}

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

static __thread uint8_t *layer_mem;
static __thread size_t layer_cap;

/* the calling thread's layer scratch at least `bytes` long; 0 when it cannot be had */
static int layer_scratch(size_t bytes) {
    if (bytes > layer_cap) {
        free(layer_mem);
        layer_mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
        layer_cap = layer_mem ? bytes : 0;
    }
    return layer_mem != NULL;
}

/* the next `bytes` of the calling thread's layer scratch, 64-byte aligned (at: the running offset) */
static inline void *carve(size_t *at, size_t bytes) {
    void *p = layer_mem + *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define Q8_LAYERS 1
#else
#define Q8_LAYERS 0
#endif

#ifdef __AVX512BW__
/* A layer's n ReLU^2 FP4 experts on one token in one parallel region, with int8 activations (int8) or fp32: x
 * quantized once (int8); every expert's up rows in one `omp for`; each expert's activation (quantized by group); the
 * n experts' down groups split into R runs, four a thread (a run crossing from one expert into the next keeps a partial
 * sum for each); then each expert's partial sums added in run order, times its down_s2. Four barriers a layer
 * where expert by expert took four an expert, and the down projection's groups spread over the team whatever their
 * count per expert (one expert's 116 over 16 threads left some threads an eighth more than others). Rows and runs go
 * to whichever thread is free (a thread the host slows does fewer; with static shares the whole call waited for it),
 * and each run sums into buffers of its own, so the outputs do not depend on which thread took which run. Per expert
 * the arithmetic is the single expert's (relu2_expert_q8_fused, sluice_fp4_relu2_expert) up to fp32 summation
 * order. 0 where it cannot run. */
static int relu2_layer(const int64_t *plan, int n, const int64_t *bases, const float *xe, const float *xo, float *y, int int8) {
    const long Dx = (long)plan[P_DX], I = (long)plan[P_I], K2u = Dx / 2, K2d = I / 2;
    const int half = (int)plan[P_HALF], e8m0 = (int)plan[P_E8M0];
    if (n < 1 || Dx % 64 || K2u % half || K2d % half || half % 4 || (int8 && (!Q8_LAYERS || K2u % 64)))
        return 0;
    const int T = omp_get_max_threads();
    const long Gd = K2d / half, Gall = n * Gd, chunks = Dx / 64, rows = team_chunk(n * I, T);
    const long R = team_runs(Gall, T), L = (Gall + R - 1) / R;  /* runs, and the longest run's groups */
    const long span = (L + Gd - 2) / Gd + 1 < n ? (L + Gd - 2) / Gd + 1 : n;  /* the experts one run touches, at most */
    if (!layer_scratch((size_t)(4 * K2u + 4 * n * I + 8 * n * K2d + 4 * n * K2d) + 4 * ((size_t)R * span + T) * Dx + 64 * 11))
        return 0;
    size_t at = 0;
    int8_t *xq = carve(&at, 2 * K2u);
    float *xs = carve(&at, K2u), *h = carve(&at, 4 * n * I), *he = carve(&at, 4 * n * K2d), *ho = carve(&at, 4 * n * K2d);
    int32_t *xc = carve(&at, K2u);
    int8_t *hq = carve(&at, 2 * n * K2d);
    float *hs = carve(&at, n * K2d);
    int32_t *hc = carve(&at, n * K2d);
    float *acc = carve(&at, 4 * (size_t)R * span * Dx), *parts = carve(&at, 4 * (size_t)T * Dx);
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
        if (int8) {
#pragma omp for schedule(static)
            for (long g0 = 0; g0 < K2u; g0 += half)
                q8_group(xe, xo, g0, half, xq, xq + K2u, xs, xc);
        }
#endif
#pragma omp for schedule(dynamic, rows)
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
        const int t = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < R; u++) {  /* run u: groups a .. b of all, into its own sums (R <= Gall: never empty) */
            const long a = Gall * u / R, b = Gall * (u + 1) / R;
            float *mine = acc + (size_t)u * span * Dx;
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
#pragma omp for schedule(static)
        for (long c = 0; c < n * chunks; c++) {
            const long e = c / chunks, n0 = c % chunks * 64;
            float *from[R];
            int np = 0;
            for (long u = 0; u < R; u++) {  /* the runs that took groups of expert e, in run order */
                const long ua = Gall * u / R, ub = Gall * (u + 1) / R;
                if (ua < (e + 1) * Gd && ub > e * Gd)
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

/* A layer's n SwiGLU FP4 experts (plain SiLU) on one token in one parallel region, int8 activations or fp32: x
 * quantized once (int8); every expert's gate and up rows in one `omp for`; silu(g) * u (quantized by group) per
 * expert; every expert's down rows in one `omp for`, rows to whichever thread is free (team_chunk). Each output is one
 * row's dot, so the result is sluice_fp4_swiglu_expert's bit for bit whatever the split. 0 where it cannot run. */
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
        if (int8) {
#pragma omp for schedule(static)
            for (long g0 = 0; g0 < K2u; g0 += half)
                q8_group(xe, xo, g0, half, xq, xq + K2u, xs, xc);
        }
#endif
#pragma omp for schedule(dynamic, team_chunk(2 * n * I, T))
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
#pragma omp for schedule(dynamic, team_chunk(n * Dx, T))
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
#pragma omp for schedule(dynamic, 1)
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
#pragma omp for schedule(dynamic, team_chunk(n * N, omp_get_num_threads()))
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

/* sluice_experts, then each expert's output [Dx] rounded to bf16 (round_x) or not, times its weight w[e], into row
 * rows[e] of out (fp32, out_bf16 = 0, or bf16 bits): the host's rows of a MoE layer in one call, as
 * `(y.to(x_dtype).float() * w[:, None]).to(out.dtype)` writes them (kernels/cpu.py `weighed_rows_ref`). */
int sluice_experts_rows(const int64_t *plan, int n, const int64_t *bases, const float *x, float *y, const float *w,
                        const int64_t *rows, int round_x, void *out, int out_bf16) {
    if (!sluice_experts(plan, n, bases, x, y))
        return 0;
    const long Dx = (long)plan[P_DX];
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
    return 1;
}
