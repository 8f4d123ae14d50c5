/* Shared by every kernel: the E2M1 and scale tables, E4M3 bytes as floats, prefetch distances, how a team splits
 * its work, the calling thread's scratch.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

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
/* per calling thread: the OpenMP team's partial sums and accumulators, [2 * threads * N] floats */
static __thread float *rows_buf;
static __thread long rows_cap;

/* the calling thread's rows_buf for a team of T threads over N outputs, or NULL when it cannot be had (the
 * team's threads see their own rows_buf: pass them this pointer) */
static float *team_buf(int T, long N) {
    long need = 2L * T * N;
    if (need > rows_cap) {
        free(rows_buf);
        rows_buf = aligned_alloc(64, (size_t)need * sizeof(float));
        rows_cap = rows_buf ? need : 0;
    }
    return rows_buf;
}
#endif

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
