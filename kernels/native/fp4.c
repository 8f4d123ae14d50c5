/* FP4 (NVFP4 / MXFP4) matvecs with fp32 activations: n-major rows, k-major (re-laid) downs.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */


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
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++)
        y[n] = fp4_row(p + n * K2, s + n * s_stride, xe, xo, K2, half, e8m0);
}

#define CHUNK 256

#ifdef __AVX512BW__
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

/* Up to ROWS inputs at once (a prompt's rows of one block, kernels/native/layers.c relu2_rows): each weight's codes
 * decoded once for all of them, each input's arithmetic fp4_row's / fp4_kgroup's in the same order, so every output
 * is the one-input kernel's bit for bit. */
#define ROWS 4

/* fp4_row over r inputs (xe[q], xo[q]): out[q] */
static inline void fp4_row_multi(const uint8_t *row, const uint8_t *srow, const float *const *xe, const float *const *xo,
                                 int r, long K2, int half, int e8m0, float *out) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    const float *lut = SCALES[e8m0 != 0];
    __m512 vacc[ROWS];
    for (int q = 0; q < r; q++)
        vacc[q] = _mm512_setzero_ps();
    long g0 = 0;
    for (; g0 + 16 <= K2; g0 += 16) {
        if (!(g0 & 63))
            prefetch(row + g0 + PF_ROW);
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + g0)));
        __m512 lo = _mm512_permutexvar_ps(c, table), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table);
        __m512 sv = half == 16 ? _mm512_set1_ps(lut[srow[g0 / 16]])
                               : _mm512_insertf32x8(_mm512_set1_ps(lut[srow[g0 / 8]]), _mm256_set1_ps(lut[srow[g0 / 8 + 1]]), 1);
        for (int q = 0; q < r; q++) {
            __m512 t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo[q] + g0), _mm512_mul_ps(lo, _mm512_loadu_ps(xe[q] + g0)));
            vacc[q] = _mm512_fmadd_ps(t, sv, vacc[q]);
        }
    }
    for (int q = 0; q < r; q++) {
        float acc = _mm512_reduce_add_ps(vacc[q]);
        for (long t0 = g0, g = g0 / half; t0 < K2; t0 += half, g++) {
            long end = t0 + half < K2 ? t0 + half : K2;
            float part = 0.0f;
            for (long j = t0; j < end; j++) {
                int b = row[j];
                part += e2m1(b & 15) * xe[q][j] + e2m1(b >> 4) * xo[q][j];
            }
            acc += part * scale_f32(srow[g], e8m0);
        }
        out[q] = acc;
    }
}

/* fp4_kgroup over r inputs: acc[q] [N] += the group's sums on xe[q], xo[q]; part[q] [N] scratch */
static inline void fp4_kgroup_multi(float *const *acc, float *const *part, int r, const uint8_t *p, const uint8_t *sr,
                                    const float *const *xe, const float *const *xo, long N, long j, long end, int e8m0) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    for (int q = 0; q < r; q++)
        for (long n = 0; n < N; n++)
            part[q][n] = 0.0f;
    for (; j + 1 < end; j += 2) {
        const uint8_t *r0 = p + j * N, *r1 = r0 + N;
        __m512 a0[ROWS], b0[ROWS], a1[ROWS], b1[ROWS];
        for (int q = 0; q < r; q++) {
            a0[q] = _mm512_set1_ps(xe[q][j]), b0[q] = _mm512_set1_ps(xo[q][j]);
            a1[q] = _mm512_set1_ps(xe[q][j + 1]), b1[q] = _mm512_set1_ps(xo[q][j + 1]);
        }
        for (long n = 0; n < N; n += 16) {
            if (!(n & 63)) {
                prefetch(r0 + n + PF_KROW);
                prefetch(r1 + n + PF_KROW);
            }
            __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + n)));
            __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r1 + n)));
            __m512 l0 = _mm512_permutexvar_ps(c0, table), h0 = _mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table);
            __m512 l1 = _mm512_permutexvar_ps(c1, table), h1 = _mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), table);
            for (int q = 0; q < r; q++) {
                __m512 v = _mm512_loadu_ps(part[q] + n);
                v = _mm512_fmadd_ps(l0, a0[q], v);
                v = _mm512_fmadd_ps(h0, b0[q], v);
                v = _mm512_fmadd_ps(l1, a1[q], v);
                v = _mm512_fmadd_ps(h1, b1[q], v);
                _mm512_storeu_ps(part[q] + n, v);
            }
        }
    }
    for (; j < end; j++) {
        const uint8_t *r0 = p + j * N;
        for (long n = 0; n < N; n += 16) {
            __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + n)));
            __m512 l0 = _mm512_permutexvar_ps(c0, table), h0 = _mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table);
            for (int q = 0; q < r; q++) {
                __m512 v = _mm512_loadu_ps(part[q] + n);
                v = _mm512_fmadd_ps(l0, _mm512_set1_ps(xe[q][j]), v);
                v = _mm512_fmadd_ps(h0, _mm512_set1_ps(xo[q][j]), v);
                _mm512_storeu_ps(part[q] + n, v);
            }
        }
    }
    for (long n = 0; n < N; n += 16) {
        __m128i b = _mm_loadu_si128((const __m128i *)(sr + n));
        __m512 sv = e8m0 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 23))
                         : _mm512_mul_ps(e4m3x16(sr + n), _mm512_set1_ps(256.0f));
        for (int q = 0; q < r; q++)
            _mm512_storeu_ps(acc[q] + n, _mm512_fmadd_ps(_mm512_loadu_ps(part[q] + n), sv, _mm512_loadu_ps(acc[q] + n)));
    }
}

/* k-major by rows: each thread takes a run of scale groups and streams their rows whole (contiguous
 * bytes, where the 64-output chunks above read 64 bytes a row at a stride of N), keeping all N
 * outputs' partial sums in L1 (part, per group) and its running sums (acc); the threads' sums are
 * added at the end. N a multiple of 16. */
static int kmajor_rows(const uint8_t *p, const uint8_t *s, long s_stride, const float *xe, const float *xo,
                       long N, long K2, int half, int e8m0, float *y) {
    int T = omp_get_max_threads();
    float *buf = team_buf(T, N);
    if (!buf)
        return 0;
    long G = (K2 + half - 1) / half;
    int used = T;
#pragma omp parallel num_threads(T)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
        used = nt;
        float *acc = buf + 2L * t * N, *part = acc + N;
        for (long n = 0; n < N; n++)
            acc[n] = 0.0f;
        for (long g = G * t / nt; g < G * (t + 1) / nt; g++)
            fp4_kgroup(acc, part, p, s + g * s_stride, xe, xo, N, g * half, g * half + half < K2 ? g * half + half : K2, e8m0);
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
