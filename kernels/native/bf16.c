/* BF16 matvecs.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

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
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++)
        y[n] = bf16_row(w + n * K, x, K);
}

void sluice_bf16_kmajor(const uint16_t *w, const float *x, long N, long K, float *y) {
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64)
        bf16_chunk(w, x, N, K, n0, y);
}
