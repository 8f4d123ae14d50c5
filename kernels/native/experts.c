/* One expert in one call (ReLU^2, its int8 variant, SwiGLU): the matvecs above with the activation between them.
 * A part of kernels/cpu_native.c's one translation unit, included in order: it sees the parts before it. */

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
