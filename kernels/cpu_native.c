/* FP4 (NVFP4 / MXFP4) matvec on the CPU over a block's stored bytes: kernels/cpu.py's native path.
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

void sluice_fp4_nmajor(const uint8_t *p, const uint8_t *s, long s_stride, const float *xe, const float *xo,
                       long N, long K2, int half, int e8m0, float *y) {
    init_scales();
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        const uint8_t *row = p + n * K2;
        const uint8_t *srow = s + n * s_stride;
        float acc = 0.0f;
        long g0 = 0, g = 0;
#if defined(__AVX512BW__)
        {  /* 16 bytes (32 codes, one or two scale groups) a step; codes looked up as floats by permutes */
            const __m512 table = _mm512_loadu_ps(E2M1);
            const float *lut = SCALES[e8m0 != 0];
            __m512 vacc = _mm512_setzero_ps();
            for (; g0 + 16 <= K2; g0 += 16) {
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
        y[n] = acc;
    }
}

#define CHUNK 256

/* E4M3 bytes -> floats / 256, vectorised: sign to bit 15 and exponent + mantissa to bits 7-14 make an
 * fp16 of the same value / 2**8 (biases 7 and 15; subnormals too), converted by vcvtph2ps */
#ifdef __AVX512F__
static inline __m512 e4m3x16(const uint8_t *p) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i f = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(f);
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

/* per calling thread: the OpenMP team's partial sums and accumulators, [2 * threads * N] floats */
static __thread float *rows_buf;
static __thread long rows_cap;

/* k-major by rows: each thread takes a run of scale groups and streams their rows whole (contiguous
 * bytes, where the 64-output chunks above read 64 bytes a row at a stride of N), keeping all N
 * outputs' partial sums in L1 (part, per group) and its running sums (acc); the threads' sums are
 * added at the end. N a multiple of 16. */
static int kmajor_rows(const uint8_t *p, const uint8_t *s, long s_stride, const float *xe, const float *xo,
                       long N, long K2, int half, int e8m0, float *y) {
    int T = omp_get_max_threads();
    long need = 2L * T * N;
    if (need > rows_cap) {
        free(rows_buf);
        rows_buf = aligned_alloc(64, (size_t)need * sizeof(float));
        rows_cap = rows_buf ? need : 0;
        if (!rows_buf)
            return 0;
    }
    long G = (K2 + half - 1) / half;
    float *buf = rows_buf;  /* the caller's: rows_buf is thread-local, the team's threads would see their own */
    int used = T;
#pragma omp parallel num_threads(T)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
        used = nt;
        float *acc = buf + 2L * t * N, *part = acc + N;
        const __m512 table = _mm512_loadu_ps(E2M1);
        for (long n = 0; n < N; n++)
            acc[n] = 0.0f;
        for (long g = G * t / nt; g < G * (t + 1) / nt; g++) {
            long j = g * half, end = j + half < K2 ? j + half : K2;
            for (long n = 0; n < N; n++)
                part[n] = 0.0f;
            for (; j + 1 < end; j += 2) {  /* two rows a pass: each output's partial sum loaded and stored once */
                const uint8_t *r0 = p + j * N, *r1 = r0 + N;
                const __m512 a0 = _mm512_set1_ps(xe[j]), b0 = _mm512_set1_ps(xo[j]);
                const __m512 a1 = _mm512_set1_ps(xe[j + 1]), b1 = _mm512_set1_ps(xo[j + 1]);
                for (long n = 0; n < N; n += 16) {
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
            const uint8_t *sr = s + g * s_stride;
            for (long n = 0; n < N; n += 16) {  /* the group's scales, 16 bytes decoded in registers */
                __m128i b = _mm_loadu_si128((const __m128i *)(sr + n));
                __m512 sv = e8m0 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 23))
                                 : _mm512_mul_ps(e4m3x16(sr + n), _mm512_set1_ps(256.0f));
                _mm512_storeu_ps(acc + n, _mm512_fmadd_ps(_mm512_loadu_ps(part + n), sv, _mm512_loadu_ps(acc + n)));
            }
        }
    }
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n += 16) {
        __m512 v = _mm512_loadu_ps(buf + n);
        for (int t = 1; t < used; t++)
            v = _mm512_add_ps(v, _mm512_loadu_ps(buf + 2L * t * N + n));
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


void sluice_fp8_nmajor(const uint8_t *w, const uint8_t *s, long s_stride, long block, int e8m0, const float *x,
                       long N, long K, float *y) {
    init_scales();
    const long B = s ? block : K;
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        const uint8_t *row = w + n * K;
        float acc = 0.0f;
        for (long k0 = 0, kb = 0; k0 < K; k0 += B, kb++) {
            long end = k0 + B < K ? k0 + B : K, k = k0;
            float part = 0.0f;
#ifdef __AVX512F__
            __m512 v = _mm512_setzero_ps();
            for (; k + 16 <= end; k += 16)
                v = _mm512_fmadd_ps(e4m3x16(row + k), _mm512_loadu_ps(x + k), v);
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
        y[n] = acc;
    }
}

void sluice_fp8_kmajor(const uint8_t *w, const uint8_t *s, long s_stride, long block, int e8m0, const float *x,
                       long N, long K, float *y) {
    init_scales();
    const long B = s ? block : K;
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64) {
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
    for (long i = 0; i < I / 2; i++) {
        float a = h[2 * i] * up_s2, b = h[2 * i + 1] * up_s2;
        a = a > 0.0f || a != a ? a : 0.0f;  /* NaN stays NaN, as torch's relu keeps it */
        b = b > 0.0f || b != b ? b : 0.0f;
        he[i] = a * a;
        ho[i] = b * b;
    }
    sluice_fp4_kmajor(down, down_s, down_s_stride, he, ho, Dx, I / 2, half, e8m0, y);
    for (long n = 0; n < Dx; n++)
        y[n] *= down_s2;
}
