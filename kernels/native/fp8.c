/* FP8 (E4M3) matvecs.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

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
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++)
        y[n] = fp8_row(w + n * K, s, s_stride, block, e8m0, x, n, K);
}

void sluice_fp8_kmajor(const uint8_t *w, const uint8_t *s, long s_stride, long block, int e8m0, const float *x,
                       long N, long K, float *y) {
    init_scales();
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64)
        fp8_chunk(w, s, s_stride, block, e8m0, x, N, K, n0, y);
}
