"""CPU expert kernels (kernels/cpu.py, kernels/cpu_native.py) against the plain-torch reference, every format and expert kind,
the re-laid K-major `down` included: the torch ops eagerly and through torch.compile, and FP4 / FP8
through the native C path (kernels/cpu_native.c)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels.cpu import CpuExperts
from sluice.kernels.experts_ref import expert_ref
from quant import FORMATS, make_bank
from test_kernels import fit

SIZES = [(64, 96), (96, 160)]  # (Dx, I)


def relu2(v):
    return torch.relu(v) ** 2


def _check(kind: str, fmt: str, Dx: int, I: int, compiled: bool, bias: bool = False, native: bool = False, mutate=None,
           fused: str = ""):
    bank, offs, manifest, dense = make_bank(kind, fmt, 2, Dx, I, seed=Dx + I, bias=bias)
    if mutate is not None:
        mutate(bank, manifest)
    act = relu2 if kind == "relu2" else F.silu
    cpu = CpuExperts(manifest, kind, act, compiled=compiled, native=native, act_name=fused)
    assert (cpu.plan is not None) == bool(fused), "the one-call expert path was (not) taken"
    for a in range(2):
        block = bank[int(offs[a]) : int(offs[a]) + manifest.block_bytes]
        x = torch.randn(Dx, generator=torch.Generator().manual_seed(a))
        got = cpu.run(block, x)
        ref = expert_ref(kind, x[None].double(), {k: v.double() for k, v in dense[a].items()}, act)[0]
        err = float((got.double() - ref).norm() / ref.norm())
        assert err < 1e-5, f"{kind}/{fmt}/{Dx}x{I}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
@pytest.mark.parametrize("Dx, I", SIZES)
def test_cpu_experts_match_the_reference(kind, fmt, Dx, I):
    Dx, I = fit(fmt, Dx, I)
    _check(kind, fmt, Dx, I, compiled=False, bias=fmt == "mxfp4" and kind == "swiglu")


@pytest.mark.parametrize("fmt, kind", [("nvfp4", "relu2"), ("fp8_block", "swiglu")])
def test_cpu_experts_compiled(fmt, kind):
    """The torch.compile'd kernels (inductor's C++ backend) give the reference's rows too."""
    _check(kind, fmt, 64, 96, compiled=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_ct", "mxfp4", "mxfp4_ds", "fp8", "fp8_row", "fp8_block", "fp8_block_e8m0", "bf16"])
@pytest.mark.parametrize("kind", ["relu2", "relu2-one-call", "swiglu", "swiglu-one-call"])
@pytest.mark.parametrize("Dx, I", SIZES + [(320, 544)])
def test_native_kernels_match_the_reference(kind, fmt, Dx, I):
    """The C kernels: both layouts, every scale kind (FP4 E4M3 / E8M0 groups; FP8 per tensor, per row, in
    blocks with F32 or E8M0 scales, blocks that end mid-row), BF16, outputs in whole 64-wide chunks and not;
    a ReLU^2 expert also in one call (up, activation, down), and a SwiGLU one with plain SiLU (gate, up, down), in
    every format (FP4: ExpertPlan.fp4; BF16 / FP8: ExpertPlan.dense)."""
    from sluice.kernels.cpu_native import native_kernels

    if native_kernels() is None:
        pytest.skip("no C compiler here: the native FP4 path is not built")
    one_call = kind.endswith("-one-call")
    Dx, I = fit(fmt, Dx, I)
    kind = kind.removesuffix("-one-call")
    _check(kind, fmt, Dx, I, compiled=False, native=True, fused=("relu2" if kind == "relu2" else "silu") if one_call else "")


def _swap_nibbles(bank, manifest):
    """Exchange the two nibbles of every byte of `up`'s packed weight (a wrong nibble order in the store)."""
    s = next(s for s in manifest.slots if s.name == "up.weight")
    for a in range(2):
        b = bank[a * manifest.block_bytes + s.offset : a * manifest.block_bytes + s.offset + s.nbytes]
        b.copy_(((b & 15) << 4) | (b >> 4))


def _shift_block_scales(bank, manifest):
    """Rotate `down`'s FP8 block scales by one tile along each row of tiles (scales applied to the wrong block)."""
    s = next(s for s in manifest.slots if s.name.startswith("down.") and s.name != "down.weight")
    for a in range(2):
        raw = bank[a * manifest.block_bytes + s.offset : a * manifest.block_bytes + s.offset + s.nbytes]
        t = raw.view(torch.float32).view(s.shape) if s.dtype == "F32" else raw.view(s.shape)
        t.copy_(t.roll(1, dims=-1))


def test_one_call_swiglu_expert_fails_on_swapped_nibbles():
    """The one-call SwiGLU FP4 expert reads `up`'s nibbles the store's way round: swapped, the match breaks."""
    from sluice.kernels.cpu_native import native_kernels

    if native_kernels() is None:
        pytest.skip("no C compiler here")
    with pytest.raises(AssertionError, match="relative error"):
        _check("swiglu", "nvfp4", 64, 96, compiled=False, native=True, mutate=_swap_nibbles, fused="silu")


@pytest.mark.parametrize("native", [False, True, "one-call"])
@pytest.mark.parametrize("fmt, Dx, I, mutate", [("nvfp4", 64, 96, _swap_nibbles), ("fp8_block", 320, 544, _shift_block_scales)],
                         ids=["nibbles-swapped", "fp8-scales-one-tile-off"])
def test_wrong_unpacking_must_fail(native, fmt, Dx, I, mutate):
    """Bytes read wrongly (FP4 nibbles the wrong way round, FP8 block scales one tile off) break the match
    in both paths: the tests above can tell."""
    from sluice.kernels.cpu_native import native_kernels

    if native and native_kernels() is None:
        pytest.skip("no C compiler here")
    with pytest.raises(AssertionError, match="relative error"):
        _check("relu2", fmt, Dx, I, compiled=False, native=bool(native), mutate=mutate, fused="relu2" if native == "one-call" else "")


def test_fp8_decodes_match_torch():
    """The integer-op decodes equal torch's own casts on every E4M3 value but NaN, and every E2M1 code."""
    from sluice.kernels.cpu import e2m1, e4m3_f32
    from sluice.kernels.formats import E2M1

    b = torch.arange(256, dtype=torch.uint8)
    v = b.view(torch.float8_e4m3fn)
    ok = ~v.float().isnan()
    assert torch.equal(e4m3_f32(v)[ok], v.float()[ok])
    assert e2m1(torch.arange(16, dtype=torch.int32)).tolist() == list(E2M1)


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("e8m0", [False, True])
def test_native_fp4_every_scale_byte(kmajor, e8m0):
    """Every scale byte (E4M3 subnormals and E8M0 extremes included; not NaN) scales its group in the C
    kernels as in the torch path, in both layouts (the re-laid one decodes scales 16 at a time in registers)."""
    from sluice.kernels.cpu import fp4_matvec
    from sluice.kernels.cpu_native import fp4_matvec_native, native_kernels

    lib = native_kernels()
    if lib is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(7)
    group = 32 if e8m0 else 16
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes >= 100) & (codes <= 154)] if e8m0 else codes[(codes & 0x7F) != 0x7F]  # E8M0: sums stay finite
    N, G = 64, -(-codes.numel() // 64) * 2  # every code appears in some (output, group)
    K2 = G * group // 2
    packed = torch.randint(0, 256, (N, K2) if not kmajor else (K2, N), dtype=torch.uint8, generator=g)
    sc = codes.repeat(-(-N * G // codes.numel()))[: N * G].reshape(N, G)
    sc = sc if not kmajor else sc.t().contiguous()
    scale = sc.view(torch.float8_e8m0fnu) if e8m0 else sc.view(torch.float8_e4m3fn)
    xe, xo = torch.randn(K2, generator=g), torch.randn(K2, generator=g)
    want = fp4_matvec(packed, scale, xe, xo, group, e8m0, kmajor).double()
    got = fp4_matvec_native(lib, packed, scale, xe, xo, group, e8m0, kmajor).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# (layout, scale kind, N outputs, K2 bytes a row): sizes off the vector widths so that the native kernels' scalar tails run:
# n-major rows whose K2 is not a multiple of AVX-512's 16 bytes (fp4_row's tail; 8 is all tail), or of more than the
# 512 groups AVX2 takes; k-major outputs not a multiple of 8 (AVX2) or 16 (AVX-512: kmajor_rows), fp4_kmajor's tail
TAILS = [("nmajor", "e4m3", 24, 40), ("nmajor", "e4m3", 5, 8), ("nmajor", "e4m3", 3, 8 * 520),
         ("kmajor", "e4m3", 13, 16), ("kmajor", "e8m0", 13, 32), ("kmajor", "e4m3", 21, 24)]


@pytest.mark.parametrize("layout, scale, N, K2", TAILS, ids=[f"{l}-{s}-{n}x{k}" for l, s, n, k in TAILS])
def test_native_fp4_scalar_tail(layout, scale, N, K2):
    """The C kernels' scalar tails (sizes not a multiple of the vector width) give the torch path's result, and read the
    nibbles the right way round: x's even and odd halves swapped (the nibbles read the other way) must not match."""
    from sluice.kernels.cpu import fp4_matvec
    from sluice.kernels.cpu_native import fp4_matvec_native, native_kernels

    lib = native_kernels()
    if lib is None:
        pytest.skip("no C compiler here")
    kmajor, e8m0 = layout == "kmajor", scale == "e8m0"
    group = 32 if e8m0 else 16
    g = torch.Generator().manual_seed(N * K2)
    G = K2 // (group // 2)
    packed = torch.randint(0, 256, (K2, N) if kmajor else (N, K2), dtype=torch.uint8, generator=g)
    codes = torch.randint(120, 134, (N, G), dtype=torch.uint8, generator=g) if e8m0 else torch.randint(0x30, 0x40, (N, G), dtype=torch.uint8, generator=g)
    codes = codes.t().contiguous() if kmajor else codes
    sc = codes.view(torch.float8_e8m0fnu) if e8m0 else codes.view(torch.float8_e4m3fn)
    xe, xo = torch.randn(K2, generator=g), torch.randn(K2, generator=g)
    want = fp4_matvec(packed, sc, xe, xo, group, e8m0, kmajor).double()
    got = fp4_matvec_native(lib, packed, sc, xe, xo, group, e8m0, kmajor).double()
    assert got.shape == (N,)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), float((got - want).abs().max())
    swapped = fp4_matvec_native(lib, packed, sc, xo, xe, group, e8m0, kmajor).double()
    assert not torch.allclose(swapped, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_native_build_failure_falls_back(monkeypatch, tmp_path):
    """A compiler that fails leaves the torch path serving FP4, with a warning, not an error."""
    import sluice.kernels.cpu_native as native

    monkeypatch.setattr(native, "_NATIVE", [])
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    assert native.native_kernels() is None
    _check("relu2", "nvfp4", 64, 96, compiled=False, native=True)


def _q8_lib():
    from sluice.kernels.cpu_native import native_kernels

    lib = native_kernels()
    if lib is None or not lib.sluice_q8_available():
        pytest.skip("no AVX-512 VNNI (or no C compiler) here: the int8 path is not built")
    return lib


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("e8m0", [False, True])
@pytest.mark.parametrize("N, K2", [(40, 128), (128, 48), (96, 96), (256, 192)])
def test_int8_fp4_kernels(kmajor, e8m0, N, K2):
    """The int8-activation FP4 kernels (AVX-512 VNNI): equal to their arithmetic in float64 (x rounded to int8 per
    scale group, exact sums; q8_reference) up to fp32 summation order, every scale byte included; within ~1% of the
    unrounded result but not equal to it (the rounding is real); sizes they do not take (n-major rows not a multiple
    of 64 bytes, k-major outputs not a multiple of 64) return None; x's even and odd elements swapped fails."""
    from sluice.kernels.cpu import _fp4_matvec_f64, q8_reference
    from sluice.kernels.cpu_native import fp4_matvec_q8_native

    lib = _q8_lib()
    g = torch.Generator().manual_seed(N + K2)
    group = 32 if e8m0 else 16
    G = K2 // (group // 2)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes >= 100) & (codes <= 154)] if e8m0 else codes[(codes & 0x7F) != 0x7F]
    sc = codes.repeat(-(-N * G // codes.numel()))[: N * G].reshape(N, G)[torch.randperm(N, generator=g)]
    sc = sc if not kmajor else sc.t().contiguous()
    scale = sc.view(torch.float8_e8m0fnu) if e8m0 else sc.view(torch.float8_e4m3fn)
    packed = torch.randint(0, 256, (K2, N) if kmajor else (N, K2), dtype=torch.uint8, generator=g)
    xe, xo = torch.randn(K2, generator=g), torch.randn(K2, generator=g)
    xe[3] = 0.0
    got = fp4_matvec_q8_native(lib, packed, scale, xe, xo, group, e8m0, kmajor)
    if (kmajor and N % 64) or (not kmajor and K2 % 64):
        assert got is None
        return
    want = q8_reference(packed, scale, xe, xo, group, e8m0, kmajor)
    exact = _fp4_matvec_f64(packed, scale, xe.double(), xo.double(), group, e8m0, kmajor)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(got, want) < 1e-5
    assert 1e-4 < rel(got, exact) < 2e-2
    assert rel(fp4_matvec_q8_native(lib, packed, scale, xo, xe, group, e8m0, kmajor), want) > 0.1


@pytest.mark.parametrize("kind, fmt", [("relu2", "nvfp4"), ("relu2", "mxfp4"), ("swiglu", "nvfp4")])
def test_int8_cpu_experts(kind, fmt):
    """A whole expert with int8 activations (the ReLU^2 one in one native call: x and relu(up)^2 each rounded per
    scale group) stays within ~2% of the reference, and differs from the fp32 path's result; the ReLU^2 one call
    gives its steps' result bit for bit."""
    _q8_lib()
    Dx, I = 128, 256
    bank, offs, manifest, dense = make_bank(kind, fmt, 2, Dx, I, seed=5)
    act = relu2 if kind == "relu2" else F.silu
    fused = "relu2" if kind == "relu2" else "silu"
    q8 = CpuExperts(manifest, kind, act, compiled=False, act_name=fused, int8=True)
    fp32 = CpuExperts(manifest, kind, act, compiled=False, act_name=fused)
    steps = CpuExperts(manifest, kind, act, compiled=False, int8=True)  # projection by projection, the activation in torch
    assert q8.int8 and q8.fused == fp32.fused == (kind == "relu2") and q8.fused_swiglu == fp32.fused_swiglu == (kind == "swiglu")
    for a in range(2):
        block = bank[int(offs[a]) : int(offs[a]) + manifest.block_bytes]
        x = torch.randn(Dx, generator=torch.Generator().manual_seed(a))
        ref = expert_ref(kind, x[None].double(), {k: v.double() for k, v in dense[a].items()}, act)[0]
        got, full = q8.run(block, x), fp32.run(block, x)
        err = float((got.double() - ref).norm() / ref.norm())
        assert 1e-4 < err < 2e-2, f"{kind}/{fmt}: relative error {err:.2e}"
        assert float((full.double() - ref).norm() / ref.norm()) < 1e-5
        if kind == "relu2":  # the one call (one parallel region) is the same arithmetic as its steps
            assert torch.equal(got, steps.run(block, x))


def native_layer(kind: str, fmt: str, seed: int, Dx: int = 128, I: int = 256):
    """Three blocks of a layout (their views of one bank), the manifest, the layout's CPU kernels with a native plan,
    the blocks' dense weights and the activation; skips where no C compiler builds the native path."""
    from sluice.kernels.cpu_native import native_kernels

    if native_kernels() is None:
        pytest.skip("no C compiler here: the native path is not built")
    bank, offs, manifest, dense = make_bank(kind, fmt, 3, Dx, I, seed=seed)
    act = relu2 if kind == "relu2" else F.silu
    cpu = CpuExperts(manifest, kind, act, compiled=False, act_name="relu2" if kind == "relu2" else "silu")
    assert cpu.plan is not None
    return [bank[int(o) : int(o) + manifest.block_bytes] for o in offs], manifest, cpu, dense, act


@pytest.mark.parametrize("kind, fmt", [("relu2", "nvfp4"), ("relu2", "mxfp4"), ("swiglu", "nvfp4"), ("relu2", "bf16"),
                                       ("relu2", "fp8_block"), ("swiglu", "fp8"), ("swiglu", "fp8_block_e8m0"), ("swiglu", "bf16")])
def test_run_many_is_run_block_by_block(kind, fmt):
    """A layer's blocks on one token in one native call (CpuExperts.run_many: the hybrid path's one-token steps) give
    each block's own run(), in the order given, and match the reference: bit for bit where each output is one row's
    or one chunk's sum; up to fp32 summation order for a ReLU^2 FP4 or FP8 layer, whose re-laid down is split over the
    threads by runs of scale groups or row tiles across expert boundaries (native/layers.c relu2_layer, native/dense.c fp8_krows_team)."""
    blocks, _, cpu, dense, act = native_layer(kind, fmt, seed=7)
    blocks, Dx = blocks[::-1], 128
    x = torch.randn(Dx, generator=torch.Generator().manual_seed(3))
    many = cpu.run_many(blocks, x)
    one = torch.stack([cpu.run(b, x) for b in blocks])
    assert many.shape == (3, Dx)
    if kind == "relu2" and fmt != "bf16":
        assert torch.allclose(many, one, rtol=1e-5, atol=1e-6 * float(one.abs().max())) and not torch.equal(many[0], many[1])
    else:
        assert torch.equal(many, one)
    for j, a in enumerate(reversed(range(3))):
        ref = expert_ref(kind, x[None].double(), {k: v.double() for k, v in dense[a].items()}, act)[0]
        assert float((many[j].double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("kind, fmt", [("relu2", "nvfp4"), ("swiglu", "nvfp4"), ("swiglu", "bf16"), ("relu2", "bf16"), ("relu2", "fp8_block"),
                                       ("swiglu", "fp8")])
def test_weighed_rows_in_the_native_call_are_torchs(kind, fmt):
    """The hybrid path's host rows (CpuExperts.weighed_rows: the experts, their rounding to the model's dtype and their
    weights in one native call) are `weighed_rows_ref`'s bit for bit, for bf16 and fp32 models and combine buffers, in
    the given rows only; the must-fail side: without the rounding to bf16 the rows differ."""
    from sluice.kernels.cpu import weighed_rows_ref

    blocks, _, cpu, _, _ = native_layer(kind, fmt, seed=11)
    Dx = 128
    x = torch.randn(Dx, generator=torch.Generator().manual_seed(4))
    w, rows = torch.tensor([0.37, 0.21, 0.11]), [4, 0, 2]
    for x_dtype in (torch.bfloat16, torch.float32):
        for out_dtype in (torch.bfloat16, torch.float32):
            got, want = torch.zeros(6, Dx, dtype=out_dtype), torch.zeros(6, Dx, dtype=out_dtype)
            cpu.weighed_rows(blocks, x, w, x_dtype, got, rows)
            weighed_rows_ref(cpu.run_many(blocks, x), w, x_dtype, want, rows)
            assert torch.equal(got, want) and not got[[1, 3, 5]].any() and got[rows].all()
    unrounded = torch.zeros(6, Dx)
    weighed_rows_ref(cpu.run_many(blocks, x), w, torch.float32, unrounded, rows)
    rounded = torch.zeros(6, Dx)
    cpu.weighed_rows(blocks, x, w, torch.bfloat16, rounded, rows)
    assert not torch.equal(rounded, unrounded)


@pytest.mark.parametrize("kind, fmt", [("relu2", "nvfp4"), ("swiglu", "nvfp4"), ("swiglu", "bf16"), ("relu2", "fp8_block")])
def test_a_prompts_pairs_in_one_native_call_are_each_blocks_own(kind, fmt):
    """A prompt's (block, row) pairs in one native call (CpuExperts.weighed_pairs: a block's rows side by side, each on
    its own input) are each pair's one-block `weighed_rows` bit for bit (in fp32 too: a block's rows decoded once
    for several, AVX-512, sum in the one-row kernel's order), and the torch path's (no native plan); the must-fail
    side: the same pairs with two inputs swapped differ in those rows."""
    by, manifest, cpu, _, act = native_layer(kind, fmt, seed=13)
    plain, Dx = CpuExperts(manifest, kind, act, compiled=False, native=False), 128
    assert plain.plan is None
    blocks = [by[0], by[0], by[2], by[1], by[1], by[1]]
    x = torch.randn(6, Dx, generator=torch.Generator().manual_seed(5))
    w, rows = torch.rand(6, generator=torch.Generator().manual_seed(6)), [5, 0, 3, 1, 4, 2]
    got, want, torch_path = (torch.zeros(7, Dx, dtype=torch.bfloat16) for _ in range(3))
    cpu.weighed_pairs(blocks, x, w, torch.bfloat16, got, rows)
    for b, xe, we, r in zip(blocks, x, w, rows):
        cpu.weighed_rows([b], xe, we[None], torch.bfloat16, want, [r])
    plain.weighed_pairs(blocks, x, w, torch.bfloat16, torch_path, rows)
    assert torch.equal(got, want) and got[rows].all() and not got[6].any()
    assert float((torch_path.float() - got.float()).norm() / got.float().norm()) < 1e-2
    exact, one_by_one = torch.zeros(7, Dx), torch.zeros(7, Dx)  # fp32 rows, unrounded: the same arithmetic, bit for bit
    cpu.weighed_pairs(blocks, x, w, torch.float32, exact, rows)
    for b, xe, we, r in zip(blocks, x, w, rows):
        cpu.weighed_rows([b], xe, we[None], torch.float32, one_by_one, [r])
    assert torch.equal(exact, one_by_one)
    swapped = torch.zeros(7, Dx, dtype=torch.bfloat16)
    cpu.weighed_pairs(blocks, x[[1, 0, 2, 3, 4, 5]], w, torch.bfloat16, swapped, rows)
    assert not torch.equal(swapped[[5, 0]], got[[5, 0]]) and torch.equal(swapped[[3, 1, 4, 2]], got[[3, 1, 4, 2]])


@pytest.mark.parametrize("threads", [1, 3, 7])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("int8", [True, False])
def test_fp4_layer_is_its_experts(int8, fmt, threads):
    """A layer's ReLU^2 FP4 experts in one parallel region (native/layers.c relu2_layer: down groups split over the team
    across expert boundaries), with int8 or fp32 activations, give each block's own run() up to fp32 summation order,
    for team sizes whose runs cross expert boundaries at different groups, and a block given twice gives the same
    output twice; a call repeated gives the same bits (each thread's run sums into its own buffers, added in thread
    order)."""
    from sluice.kernels.cpu_native import native_kernels

    lib = native_kernels()
    if lib is None or (int8 and not lib.sluice_q8_available()):
        pytest.skip("no AVX-512 VNNI (or no C compiler) here")
    Dx, I = 128, 320
    bank, offs, manifest, dense = make_bank("relu2", fmt, 4, Dx, I, seed=11)
    cpu = CpuExperts(manifest, "relu2", relu2, compiled=False, act_name="relu2", int8=int8, threads=threads)
    blocks = [bank[int(o) : int(o) + manifest.block_bytes] for o in offs]
    blocks = [blocks[2], blocks[0], blocks[3], blocks[1], blocks[2]]
    x = torch.randn(Dx, generator=torch.Generator().manual_seed(5))
    many = cpu.run_many(blocks, x)  # on `threads` OpenMP threads (the plan sets them per call)
    one = torch.stack([cpu.run(b, x) for b in blocks])
    assert many.shape == (5, Dx)
    assert torch.allclose(many, one, rtol=1e-5, atol=1e-6 * float(one.abs().max()))
    assert not torch.equal(many[0], many[1])
    assert all(torch.equal(cpu.run_many(blocks, x), many) for _ in range(8))
    for j, a in enumerate([2, 0, 3, 1, 2]):
        ref = expert_ref("relu2", x[None].double(), {k: v.double() for k, v in dense[a].items()}, relu2)[0]
        err = float((many[j].double() - ref).norm() / ref.norm())
        assert (1e-4 < err < 2e-2) if int8 else err < 1e-5, f"{fmt}: block {a}: relative error {err:.2e}"


@pytest.mark.parametrize("threads", [1, 3])
def test_int8_swiglu_layer_is_its_experts(threads):
    """A layer's SwiGLU FP4 experts with int8 activations in one parallel region (native/layers.c swiglu_layer): each
    output is one row's dot, so every block's output is its own int8 run()'s bit for bit, in the order given."""
    from sluice.kernels.cpu_native import native_kernels

    lib = native_kernels()
    if lib is None or not lib.sluice_q8_available():
        pytest.skip("no AVX-512 VNNI (or no C compiler) here")
    Dx, I = 128, 256
    bank, offs, manifest, dense = make_bank("swiglu", "nvfp4", 3, Dx, I, seed=13)
    cpu = CpuExperts(manifest, "swiglu", F.silu, compiled=False, act_name="silu", int8=True, threads=threads)
    blocks = [bank[int(o) : int(o) + manifest.block_bytes] for o in offs][::-1]
    x = torch.randn(Dx, generator=torch.Generator().manual_seed(2))
    many = cpu.run_many(blocks, x)  # on `threads` OpenMP threads (the plan sets them per call)
    one = torch.stack([cpu.run(b, x) for b in blocks])
    assert torch.equal(many, one)
    for j, a in enumerate(reversed(range(3))):
        ref = expert_ref("swiglu", x[None].double(), {k: v.double() for k, v in dense[a].items()}, F.silu)[0]
        err = float((many[j].double() - ref).norm() / ref.norm())
        assert 1e-4 < err < 2e-2, f"block {a}: relative error {err:.2e}"
