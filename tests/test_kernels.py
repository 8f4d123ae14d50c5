"""Triton kernels against their plain-torch references, over formats and sizes.

On a CPU these run under TRITON_INTERPRET=1 (conftest sets it); with SLUICE_TEST_DEVICE=cuda on the GPU.
NVFP4 decoding is checked against nvidia-modelopt's own code, MXFP4 against transformers' own, and
checks that must fail (swapped nibbles, scales applied to the wrong group) are included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sluice.kernels.decode import matvec
from sluice.kernels.down import down_relaid
from sluice.kernels.formats import mxfp4_dequant_ref, nvfp4_dequant_ref
from sluice.kernels.layout import proj_layouts
from common import DEVICE
from quant import make_bank, modelopt_dequant, need_modelopt, quantize

SIZES = [(1, 64, 32), (3, 96, 48), (2, 32, 80)]  # (A, Dx, I)
FORMATS = ["fp32", "bf16", "fp8", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "nvfp4_ct", "mxfp4", "mxfp4_ds"]


def fit(fmt: str, *dims: int) -> list[int]:
    """Sizes a format can hold: MXFP4 scales groups of 32 inputs."""
    g = 32 if fmt.startswith("mxfp4") else 1
    return [-(-d // g) * g for d in dims]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_ct"])
def test_nvfp4_decode_matches_modelopt(fmt):
    need_modelopt()
    w = torch.randn(48, 64) * 3
    t = quantize(w, fmt)
    packed = t.get("weight", t.get("weight_packed"))
    s2 = t["weight_scale_2"] if fmt == "nvfp4" else 1.0 / t["weight_global_scale"]
    ours = nvfp4_dequant_ref(packed, t["weight_scale"], s2)
    assert torch.equal(ours, modelopt_dequant(t))
    assert rel_err(ours, w) < 0.15  # 4-bit: close to the original, not equal


def test_plain_nvfp4_quantiser_is_modelopts():
    """The round-to-nearest NVFP4 quantiser a GPU run without modelopt uses (tests/quant.py) gives modelopt's own codes
    and scales, over groups of unlike size and an all-zero group."""
    need_modelopt()
    from quant import _nvfp4_nearest, modelopt_nvfp4

    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 128, generator=g) * torch.tensor([1.0, 8.0, 0.5, 30.0]).repeat_interleave(32)
    w[3, 16:32] = 0
    packed, s, s2 = _nvfp4_nearest(w)
    q, ms, ms2 = modelopt_nvfp4().quantize(w, 16)
    assert torch.equal(packed, q._quantized_data) and torch.equal(s.view(torch.uint8), ms.view(torch.uint8))
    assert float(s2) == float(ms2)


def test_wrong_nibble_order_and_wrong_groups_fail():
    need_modelopt()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g) * torch.tensor([1.0, 8.0, 0.5, 30.0]).repeat_interleave(16)  # groups of unlike size
    t = quantize(w, "nvfp4")
    ref = modelopt_dequant(t)
    swapped = ((t["weight"] & 0x0F) << 4) | (t["weight"] >> 4)
    assert rel_err(nvfp4_dequant_ref(swapped, t["weight_scale"], t["weight_scale_2"]), ref) > 0.5
    shifted = torch.roll(t["weight_scale"].view(torch.uint8), 1, dims=1).view(torch.float8_e4m3fn)
    assert rel_err(nvfp4_dequant_ref(t["weight"], shifted, t["weight_scale_2"]), ref) > 1.0


def test_mxfp4_decode_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 48, 4, 16), dtype=torch.uint8, generator=g)  # [E, out, in/32, 16]
    scales = torch.randint(120, 134, (3, 48, 4), dtype=torch.uint8, generator=g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for e in range(3):
        assert torch.equal(mxfp4_dequant_ref(blocks[e].reshape(48, -1), scales[e]), theirs[e].t())


def test_mxfp4_wrong_nibble_order_and_wrong_groups_fail():
    from tiny import quantize_mxfp4

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * torch.tensor([1.0, 8.0, 0.5, 30.0]).repeat_interleave(32)
    blocks, scales = quantize_mxfp4(w)
    packed = blocks.reshape(32, -1)
    ref = mxfp4_dequant_ref(packed, scales)
    assert rel_err(ref, w) < 0.2
    assert rel_err(mxfp4_dequant_ref(((packed & 0x0F) << 4) | (packed >> 4), scales), ref) > 0.5
    assert rel_err(mxfp4_dequant_ref(packed, torch.roll(scales, 1, dims=1)), ref) > 1.0


def _to(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("A, Dx, I", SIZES)
def test_relu2_decode(fmt, A, Dx, I):
    Dx, I = fit(fmt, Dx, I)
    bank, offs, manifest, dense = make_bank("relu2", fmt, A, Dx, I, seed=A + Dx)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(Dx, device=DEVICE)
    h = torch.empty(A, I, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "relu2", torch.float32, h)
    h_ref = torch.stack([torch.relu(d["up"].double() @ x.double().cpu()) ** 2 for d in dense])
    assert h.shape == (A, I) and rel_err(h.cpu(), h_ref) < 1e-5
    part, live = down_relaid(bank, offs, h, lay["down"], skip=False)
    y = part.sum(1)
    y_ref = torch.stack([dense[a]["down"].double() @ h.double().cpu()[a] for a in range(A)])
    assert y.shape == (A, Dx) and rel_err(y.cpu(), y_ref) < 1e-5
    assert int(live.sum()) == A * I // 16


@pytest.mark.parametrize("T,K,D,y_dtype,dtype", [(1, 8, 2048, torch.bfloat16, torch.bfloat16), (3, 2, 70, torch.float32, torch.bfloat16),
                                               (2, 4, 1500, torch.float32, torch.float32), (5, 1, 33, torch.bfloat16, torch.float16)])
def test_ordered_sum_kernel_is_its_reference(T, K, D, y_dtype, dtype):
    """A routed sum in one launch (what a GPU runs): bit for bit the K + 2 torch ops of the reference, on strided rows
    (a [T, K, D] view of [T*K, D]); the terms in another order differ (the must-fail side)."""
    from sluice.kernels.down import ordered_sum_kernel, ordered_sum_ref

    g = torch.Generator().manual_seed(T * K * D)
    y = (torch.randn(T * K, D + 3, generator=g) * torch.logspace(-3, 3, K).repeat(T)[:, None]).to(y_dtype).to(DEVICE)
    y = y[:, :D].view(T, K, D)
    want = ordered_sum_ref(y, dtype)
    got = ordered_sum_kernel(y, dtype)
    assert got.dtype == dtype and got.shape == (T, D) and torch.equal(got, want)
    if K > 2 and y_dtype == torch.float32:
        assert not torch.equal(ordered_sum_kernel(y.flip(1), dtype), want)


DTYPES = [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("A, S, Dx, x_dtype, y_dtype", [  # a real size once in CI's suite (~13 s each interpreted)
    *[(1, 3, 70, x, y) for x, y in DTYPES], *[(4, 16, 300, x, y) for x, y in DTYPES], (6, 32, 1024, *DTYPES[0]),
    *[pytest.param(6, 32, 1024, x, y, marks=pytest.mark.slow) for x, y in DTYPES[1:]]])
def test_weigh_parts_is_its_reference(A, S, Dx, x_dtype, y_dtype):
    """The down projection's tail in one launch: bit for bit its plain-torch reference (splits summed in order), live
    groups counted onto the total; an expert's weight given to another, or the splits summed in torch's own order
    rounded through a coarser dtype, differ; summed over the experts in order, `ordered_sum` of those rows."""
    from sluice.kernels.down import ordered_sum, weigh_parts, weigh_parts_ref

    g = torch.Generator().manual_seed(A * S)
    part = (torch.randn(A, S, Dx, generator=g) * 3).to(DEVICE)
    w = torch.rand(A, generator=g).to(DEVICE)
    live = torch.randint(0, 9, (A, S), dtype=torch.int32, generator=g).to(DEVICE)
    total, total_ref = (torch.full((), 5, dtype=torch.int64, device=DEVICE) for _ in range(2))
    y = weigh_parts(part, w, live, total, x_dtype, y_dtype)
    want = weigh_parts_ref(part, w, live, total_ref, x_dtype, y_dtype)
    assert y.dtype == y_dtype and torch.equal(y, want)
    assert int(total) == int(total_ref) == 5 + int(live.sum())
    if A > 1:
        assert not torch.equal(weigh_parts(part, w.roll(1), live, total, x_dtype, y_dtype), want)
    half = (part.sum(1).half().float() * w[:, None]).to(y_dtype)
    assert not torch.equal(half, want)
    summed = weigh_parts(part, w, live, total, x_dtype, y_dtype, summed=True)  # a one-token step's routed sum
    assert summed.dtype == x_dtype and torch.equal(summed, ordered_sum(want[None], x_dtype))
    assert torch.equal(summed, weigh_parts_ref(part, w, live, total_ref, x_dtype, y_dtype, summed=True))
    if A > 2 and x_dtype == torch.float32:  # the terms added in another order (a bf16 result may round both alike)
        assert not torch.equal(summed, ordered_sum(want.flip(0)[None], x_dtype))
    gpu_nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)  # a GPU's NaN: its low bits all set
    part[0, 0, 0] = gpu_nan.to(DEVICE)[0]
    assert weigh_parts(part, w, live, total, x_dtype, y_dtype)[0, 0].isnan()  # kept through the bf16 rounding


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4", "mxfp4"])
def test_zero_skip_reads_only_live_groups_and_changes_nothing(fmt):
    A, Dx, I = 2, 64, 96
    bank, offs, manifest, dense = make_bank("relu2", fmt, A, Dx, I, seed=3)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)["down"]
    h = torch.relu(torch.randn(A, I, device=DEVICE)) ** 2
    h.view(A, -1, 16)[:, ::2] = 0  # every other 16-neuron group dead
    h[0, 16 + 3] = 0.5  # ... except one neuron that revives a group
    full, live_full = down_relaid(bank, offs, h, lay, skip=False)
    skip, live = down_relaid(bank, offs, h, lay, skip=True)
    assert torch.equal(full.sum(1), skip.sum(1))
    expected = int((h.view(A, -1, 16) != 0).any(-1).sum())
    assert int(live.sum()) == expected < int(live_full.sum())


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4", "mxfp4"])
def test_down_host_hint_changes_only_rounding(fmt):
    """The re-laid down's alignment hint for blocks read from host memory (the direct schedule's `host_hint`) changes
    how rows load, and on a GPU the order of the partial sums' additions (FP4 / FP8: the last bits differ): the
    partials agree within fp32 rounding."""
    A, Dx, I = 3, 64, 96
    bank, offs, manifest, dense = make_bank("relu2", fmt, A, Dx, I, seed=11)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)["down"]
    h = torch.relu(torch.randn(A, I, device=DEVICE)) ** 2
    want = down_relaid(bank, offs, h, lay, skip=False, host=False)
    got = down_relaid(bank, offs, h, lay, skip=False, host=True)
    assert rel_err(got[0].cpu(), want[0].cpu()) < 1e-6 and torch.equal(got[1], want[1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("A, Dx, I", SIZES[:2])
def test_swiglu_decode(fmt, A, Dx, I):
    import torch.nn.functional as F

    Dx, I = fit(fmt, Dx, I)
    bank, offs, manifest, dense = make_bank("swiglu", fmt, A, Dx, I, seed=A * 7)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(Dx, device=DEVICE)
    h = torch.empty(A, I, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "swiglu", torch.float32, h, gate=lay["gate"], act=1)
    xd = x.double().cpu()
    h_ref = torch.stack([F.silu(d["gate"].double() @ xd) * (d["up"].double() @ xd) for d in dense])
    assert rel_err(h.cpu(), h_ref) < 1e-5
    y = torch.full((A + 2, Dx), float("nan"), device=DEVICE)
    rows = torch.tensor([2, 0, 3][:A], device=DEVICE)
    wts = torch.rand(A, device=DEVICE)
    matvec(bank, offs, h, lay["down"], "weighted", torch.float32, y, rows=rows, wts=wts)
    for a in range(A):
        ref = (dense[a]["down"].double() @ h.double().cpu()[a]) * float(wts[a])
        assert rel_err(y[rows[a]].cpu(), ref) < 1e-5


def test_kernel_fails_on_swapped_nibbles():
    A, Dx, I = 2, 64, 32
    bank, offs, manifest, dense = make_bank("relu2", "nvfp4", A, Dx, I, seed=9)
    lay = proj_layouts(manifest.formats, manifest.slots)
    up = lay["up"]
    bad = bank.clone()
    for a in range(A):
        s = a * manifest.block_bytes + up.w_off
        b = bad[s : s + I * Dx // 2]
        bad[s : s + I * Dx // 2] = ((b & 0x0F) << 4) | (b >> 4)
    x = torch.randn(Dx, device=DEVICE)
    h_ref = torch.stack([torch.relu(d["up"].double() @ x.double().cpu()) ** 2 for d in dense])
    good, wrong = torch.empty(A, I, device=DEVICE), torch.empty(A, I, device=DEVICE)
    matvec(bank.to(DEVICE), offs.to(DEVICE), x, up, "relu2", torch.float32, good)
    matvec(bad.to(DEVICE), offs.to(DEVICE), x, up, "relu2", torch.float32, wrong)
    assert rel_err(good.cpu(), h_ref) < 1e-5 and rel_err(wrong.cpu(), h_ref) > 0.3


def _rows(counts, T, K, seed=0):
    """Random (token, k) rows for experts with `counts` rows each: xrows (token ids) and flat y rows."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(T * K, generator=g)[: sum(counts)]
    return flat // K, flat


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
@pytest.mark.parametrize("bk", [0, 16])  # 0: the format's default tile; 16: narrower than an MXFP4 group's bytes
def test_prefill_grouped_gemm(fmt, kind, bk):
    import torch.nn.functional as F

    from sluice.kernels.prefill import grouped_gemm, tile_items

    if bk == 16 and fmt.startswith(("nvfp4", "mxfp4")) and DEVICE != "cpu":
        pytest.skip("an FP4 step of 16 inputs is a dot over 8 bytes: a GPU's tl.dot needs 16")
    A, Dx, I, T, K, bm = 3, 64, 48, 20, 4, 16
    Dx, I = fit(fmt, Dx, I)
    counts = [5, 17, 1]  # one expert spans two row tiles
    bank, offs, manifest, dense = make_bank(kind, fmt, A, Dx, I, seed=11)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(T, Dx, device=DEVICE)
    xrows, flat = _rows(counts, T, K)
    items = torch.tensor(tile_items(counts, bm), dtype=torch.int32, device=DEVICE)
    xrows, flat = xrows.to(DEVICE), flat.to(DEVICE)
    R = sum(counts)
    h = torch.empty(R, I, device=DEVICE)
    if kind == "relu2":
        grouped_gemm(bank, offs, x, xrows, items, lay["up"], "relu2", torch.float32, h, bm=bm, bk=bk)
    else:
        grouped_gemm(bank, offs, x, xrows, items, lay["up"], "swiglu", torch.float32, h, gate=lay["gate"], act=1, bm=bm, bk=bk)
    y = torch.full((T * K, Dx), float("nan"), device=DEVICE)
    wts = torch.rand(R, device=DEVICE)
    grouped_gemm(bank, offs, h, torch.arange(R, device=DEVICE), items, lay["down"], "weighted", torch.float32, y, orows=flat, wts=wts, bm=bm,
                 bk=bk)
    start = 0
    for a, c in enumerate(counts):
        xa = x.double().cpu()[xrows[start : start + c].cpu()]
        d = {p: w.double() for p, w in dense[a].items()}
        ha = torch.relu(xa @ d["up"].t()) ** 2 if kind == "relu2" else F.silu(xa @ d["gate"].t()) * (xa @ d["up"].t())
        assert rel_err(h[start : start + c].cpu(), ha) < 1e-5
        ya = (h[start : start + c].double().cpu() @ d["down"].t()) * wts[start : start + c].double().cpu()[:, None]
        assert rel_err(y[flat[start : start + c]].cpu(), ya) < 1e-5
        start += c
    untouched = torch.ones(T * K, dtype=torch.bool)
    untouched[flat.cpu()] = False
    assert torch.isnan(y.cpu()[untouched]).all()  # rows not routed here are left alone


@pytest.mark.parametrize("fmt, act", [("bf16", "gpt_oss_glu"), ("mxfp4", "gpt_oss_glu"), ("fp8", "silu_clamped")])
def test_clamped_gates_with_biases(fmt, act):
    """gpt-oss's clamped GLU and DeepSeek-V4's clamped SiLU gate, with biases on every projection, in the
    decode and prefill kernels against the plain-torch reference; gate values beyond the limit included."""
    from sluice.kernels.decode import ACTS
    from sluice.kernels.experts_ref import swiglu_expert_ref
    from sluice.kernels.prefill import grouped_gemm, tile_items

    alpha, limit = 1.702, 0.7  # a low limit so that the clamps bind
    A, Dx, I = 2, 64, 32
    bank, offs, manifest, dense = make_bank("swiglu", fmt, A, Dx, I, seed=5, scale=0.3, bias=True)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    assert all(lay[p].b_off >= 0 for p in ("gate", "up", "down"))

    def glu(g, u):
        g = g.clamp(max=limit)
        if act == "silu_clamped":
            return torch.nn.functional.silu(g) * u.clamp(-limit, limit)
        return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))

    def ref(a, x):
        d = {k: v.double() for k, v in dense[a].items()}
        bias = {p: d[f"{p}.bias"] for p in ("gate", "up", "down")}
        return swiglu_expert_ref(x.double().cpu(), d["gate"], d["up"], d["down"], None, glu, bias)

    x = torch.randn(Dx, device=DEVICE)
    h = torch.empty(A, I, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "swiglu", torch.float32, h, gate=lay["gate"], act=ACTS[act], act_args=(alpha, limit))
    y = torch.empty(A, Dx, device=DEVICE)
    wts = torch.rand(A, device=DEVICE)
    matvec(bank, offs, h, lay["down"], "weighted", torch.float32, y, rows=torch.arange(A, device=DEVICE), wts=wts)
    for a in range(A):
        gate_out = dense[a]["gate"].double() @ x.double().cpu() + dense[a]["gate.bias"].double()
        assert (gate_out > limit).any()
        assert rel_err(y[a].cpu(), ref(a, x[None])[0] * float(wts[a])) < 1e-5

    T, counts = 6, [4, 2]
    xt = torch.randn(T, Dx, device=DEVICE)
    items = torch.tensor(tile_items(counts, 16), dtype=torch.int32, device=DEVICE)
    xrows = torch.tensor([0, 2, 3, 5, 1, 2], device=DEVICE)
    hp = torch.empty(T, I, device=DEVICE)
    grouped_gemm(bank, offs, xt, xrows, items, lay["up"], "swiglu", torch.float32, hp, gate=lay["gate"], act=ACTS[act],
                 act_args=(alpha, limit))
    yp = torch.empty(T, Dx, device=DEVICE)
    ones = torch.ones(T, device=DEVICE)
    grouped_gemm(bank, offs, hp, torch.arange(T, device=DEVICE), items, lay["down"], "weighted", torch.float32, yp,
                 orows=torch.arange(T, device=DEVICE), wts=ones)
    assert rel_err(yp[:4].cpu(), ref(0, xt[xrows[:4]])) < 1e-5 and rel_err(yp[4:].cpu(), ref(1, xt[xrows[4:]])) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_ct", "mxfp4"])
@pytest.mark.parametrize("A, Dx, I", SIZES)
@pytest.mark.parametrize("words", [3, 2, 1, 0])
def test_fp4_decode_every_formulation(fmt, A, Dx, I, words):
    """Every FP4 matvec formulation (32-bit words of eight nibbles with contiguous or gathered scales; byte
    tiles; for NVFP4 also words through the e4m3 conversion and f16x2 FMAs, MXFP4 reading that as 2) gives the
    reference's rows: within fp32 rounding, or fp16's for the f16x2 path."""
    Dx, I = fit(fmt, Dx, I)
    bank, offs, manifest, dense = make_bank("swiglu", fmt, A, Dx, I, seed=A + 5)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(Dx, device=DEVICE)
    h = torch.empty(A, I, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "plain", torch.float32, h, fp4_words=words, bk=64)
    h_ref = torch.stack([d["up"].double() @ x.double().cpu() for d in dense])
    assert rel_err(h.cpu(), h_ref) < (3e-3 if words == 3 and fmt.startswith("nvfp4") else 1e-5)


@pytest.mark.parametrize("scale", [1e-30, 1e-4, 1.0, 1e4, 1e30])
def test_fp4_f16x2_path_scales_x_into_fp16(scale):
    """The f16x2 NVFP4 path packs x as fp16 pairs scaled by a power of two: rows stay within fp16 rounding of the
    reference for inputs far outside fp16's range (and one huge outlier); reading each nibble with its
    neighbour's x (pairs in the wrong order) does not."""
    from sluice.kernels.decode import x_pairs

    bank, offs, manifest, dense = make_bank("swiglu", "nvfp4", 2, 96, 48, seed=3)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(96, device=DEVICE) * scale
    x[7] *= 50
    h = torch.empty(2, 48, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "plain", torch.float32, h, fp4_words=3, bk=32)
    h_ref = torch.stack([d["up"].double() @ x.double().cpu() for d in dense])
    assert rel_err(h.cpu(), h_ref) < 3e-3
    xq, xinv = x_pairs(x)
    assert xq.shape == (1, 4, 12) and float(xinv[0]) > 0
    swapped = xq[:, [2, 3, 0, 1]]  # each nibble dotted with its neighbour's element
    import sluice.kernels.decode as dec

    real = dec.x_pairs
    dec.x_pairs = lambda v, fp8=False: (swapped.contiguous(), xinv)
    try:
        matvec(bank, offs, x, lay["up"], "plain", torch.float32, h, fp4_words=3, bk=32)
    finally:
        dec.x_pairs = real
    assert rel_err(h.cpu(), h_ref) > 0.2



def test_fp4_words_step_narrower_than_a_scale_group():
    """MXFP4 (32-input groups) in 16-input steps: the contiguous-scale formulation has no whole group in a
    step, so matvec reads it with per-word scales; the rows still equal the reference."""
    bank, offs, manifest, dense = make_bank("swiglu", "mxfp4", 2, 64, 32, seed=11)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(64, device=DEVICE)
    h = torch.empty(2, 32, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "plain", torch.float32, h, fp4_words=2, bk=16)
    h_ref = torch.stack([d["up"].double() @ x.double().cpu() for d in dense])
    assert rel_err(h.cpu(), h_ref) < 1e-5


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs")
def test_expert_graph_capture_while_another_thread_pins_memory():
    """A one-token expert batch is captured as a CUDA graph while the hybrid path's worker thread may be
    allocating pinned memory for its outputs: the capture must not fail (nor break the other thread)."""
    import threading

    from sluice.kernels.experts import TritonExperts

    bank, offs, manifest, dense = make_bank("relu2", "nvfp4", 4, 64, 96, seed=3)
    bank, offs = bank.to(DEVICE), offs.to(DEVICE)
    kern = TritonExperts(manifest, "relu2", "relu2", torch.device(DEVICE), graphs=True)
    errors, stop, started = [], threading.Event(), threading.Event()

    def pin():  # as the hybrid worker does: pin a fresh output, copy it to the GPU, drop it (its block is reused)
        side = torch.cuda.Stream()
        try:
            with torch.cuda.stream(side):
                while not stop.is_set():
                    torch.randn(8, 64).pin_memory().to(DEVICE, non_blocking=True)
                    started.set()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=pin)
    worker.start()
    started.wait(30)
    try:
        for A in range(1, 5):  # each batch size is a new capture
            x = torch.randn(1, 64, device=DEVICE, dtype=torch.bfloat16)
            w = torch.rand(A, device=DEVICE)
            for _ in range(2):  # eager then captured
                y = torch.zeros(A, 64, device=DEVICE, dtype=torch.bfloat16)
                kern.run(bank, offs[:A], bank, offs[:A], [1] * A, torch.arange(A, device=DEVICE), A, x, w, y, False)
        torch.cuda.synchronize()
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert len(kern._graphs) == 4


@pytest.mark.parametrize("fmt", ["fp8", "fp8_row", "fp8_block", "fp8_block_e8m0"])
@pytest.mark.parametrize("scale", [1e-39, 1e-20, 1.0, 1e20])
def test_fp8_matvec_f16x2(fmt, scale):
    """FP8 matvecs through f16x2 (int32 words of four E4M3 inputs, x packed as scaled fp16 pairs): within fp16 rounding
    of the reference for x far outside fp16's range (with an outlier; 1e-39: a row too small to scale into range, whose
    unscale must stay a normal float), every FP8 scale layout, gate+up and the weighted down alike, each expert with its
    own input rows (36 inputs to the down: a row of x pairs is not a multiple of eight inputs); x's pairs swapped (each
    input with its neighbour's weight) is far off."""
    import sluice.kernels.decode as dec

    A, Dx, I = 3, 96, 36
    bank, offs, manifest, dense = make_bank("swiglu", fmt, A, Dx, I, seed=7)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(Dx, device=DEVICE) * scale
    x[5] *= 40
    h = torch.empty(A, I, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "plain", torch.float32, h, fp4_words=3, bk=32)
    ref = torch.stack([d["up"].double() @ x.double().cpu() for d in dense])
    err = lambda got, want: rel_err(got.cpu().double() / scale, want / scale)  # noqa: E731 - relative at any scale
    assert err(h, ref) < 3e-3
    hd = torch.randn(A, I, device=DEVICE) * scale
    y = torch.empty(A, Dx, device=DEVICE)
    w = torch.rand(A, device=DEVICE)
    matvec(bank, offs, hd, lay["down"], "weighted", torch.float32, y, rows=torch.arange(A, device=DEVICE), wts=w, fp4_words=3, bk=32)
    ref_y = torch.stack([(dense[a]["down"].double() @ hd[a].double().cpu()) * float(w[a]) for a in range(A)])
    assert err(y, ref_y) < 3e-3
    real = dec.x_pairs
    dec.x_pairs = lambda v, fp8=False: (lambda q, inv: (((q << 16) | ((q >> 16) & 0xFFFF)).contiguous(), inv))(*real(v, fp8))
    try:
        matvec(bank, offs, x, lay["up"], "plain", torch.float32, h, fp4_words=3, bk=32)
    finally:
        dec.x_pairs = real
    assert err(h, ref) > 0.2


@pytest.mark.parametrize("Dx, I", [(208, 48), (256, 64)])
def test_f16x2_words_loaded_ahead_or_not_give_the_same_rows(Dx, I):
    """`ahead` only changes when a step's words are requested: the rows are the same bit for bit, and the reference's
    within fp16 rounding, over several steps with a partial last one and over whole tiles (no bounds tested)."""
    bank, offs, manifest, dense = make_bank("swiglu", "nvfp4", 2, Dx, I, seed=9)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(Dx, device=DEVICE)
    h0, h1 = torch.empty(2, I, device=DEVICE), torch.empty(2, I, device=DEVICE)
    matvec(bank, offs, x, lay["up"], "plain", torch.float32, h0, fp4_words=3, bk=64, ahead=False)
    matvec(bank, offs, x, lay["up"], "plain", torch.float32, h1, fp4_words=3, bk=64, ahead=True)
    assert torch.equal(h0, h1) and h0.abs().sum() > 0
    assert rel_err(h0.cpu(), torch.stack([d["up"].double() @ x.double().cpu() for d in dense])) < 3e-3


@pytest.mark.parametrize("words, A, Dx, I, fmt", [(3, 2, 64, 48, "nvfp4"), (2, 2, 64, 48, "nvfp4"), (3, 3, 96, 80, "nvfp4"),
                                                # CI: 2 words by (2, 2, 64, 48), this size by 3 words (slow interpreted)
                                                pytest.param(2, 3, 96, 80, "nvfp4", marks=pytest.mark.slow), (3, 2, 64, 48, "fp8_block")])
def test_up_epilogue_packs_h_as_h_pairs(words, A, Dx, I, fmt):
    """matvec's relu2 epilogue with `pairs` writes h's f16x2 pairs and per-group unscales exactly as h_pairs packs the
    h it stored (down_relaid then reads them without a packing launch); h itself is unchanged; 16-row groups that a
    tile boundary would split are refused (bn raised to 16)."""
    from sluice.kernels.down import h_pairs

    bank, offs, manifest, dense = make_bank("relu2", fmt, A, Dx, I, seed=A + I)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)
    x = torch.randn(Dx, device=DEVICE, dtype=torch.bfloat16)
    h, h_plain = (torch.empty(A, I, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    pairs = (torch.empty(A, I // 2, dtype=torch.int32, device=DEVICE), torch.empty(A, I // 16, device=DEVICE))
    fp8 = fmt.startswith("fp8")
    matvec(bank, offs, x, lay["up"], "relu2", torch.bfloat16, h, fp4_words=words, pairs=pairs, pairs_fp8=fp8, bn=8)
    matvec(bank, offs, x, lay["up"], "relu2", torch.bfloat16, h_plain, fp4_words=words, bn=8)
    assert torch.equal(h, h_plain) and (h == 0).any() and (h > 0).any()
    hq, hginv = h_pairs(h, fp8)
    assert torch.equal(pairs[0], hq) and torch.equal(pairs[1], hginv)
    part, live = down_relaid(bank, offs, h, lay["down"], skip=True, f16x2=True, pairs=pairs)
    part2, live2 = down_relaid(bank, offs, h, lay["down"], skip=True, f16x2=True)
    assert torch.equal(part, part2) and torch.equal(live, live2)


@pytest.mark.parametrize("fmt, A, Dx, I, scale", [  # CI's suite: a partial second tile (528); three tiles slow interpreted
    (f, *c) for f in ("nvfp4", "nvfp4_ct") for c in [(1, 64, 32, 1.0), (3, 96, 48, 1e-20)]]
    + [("nvfp4", 2, 528, 48, 1e20), pytest.param("nvfp4", 2, 1040, 80, 1e20, marks=pytest.mark.slow),
       pytest.param("nvfp4_ct", 2, 1040, 80, 1e20, marks=pytest.mark.slow)]
    + [(f, 3, 96, 48, 1e-20) for f in ("fp8", "fp8_row", "fp8_block", "fp8_block_e8m0")] + [("fp8", 1, 64, 32, 1e20)]
    + [("fp8_row", 2, 64, 32, 1e-39)]
    + [pytest.param("fp8_block", 2, 1040, 80, 1.0, marks=pytest.mark.slow)])
def test_relaid_down_f16x2(fmt, A, Dx, I, scale):
    """The re-laid NVFP4 or FP8 down through f16x2 (h packed as scaled fp16 pairs, each group's rows as int32 words):
    within fp16 rounding of the reference for h far outside fp16's range (with an outlier), columns past a tile's end
    masked (528 outputs: tiles of 512, the second partial; 1040: three), zero-skip counting as the fp32 path; h pairs
    swapped (each nibble with its neighbour's activation) or two groups' rows exchanged are far off."""
    from sluice.kernels import down as dec

    bank, offs, manifest, dense = make_bank("relu2", fmt, A, Dx, I, seed=A + Dx)
    bank, offs = _to(bank, offs)
    lay = proj_layouts(manifest.formats, manifest.slots)["down"]
    h = (torch.relu(torch.randn(A, I, device=DEVICE)) ** 2) * scale
    h[:, 5] *= 40
    h.view(A, -1, 16)[:, 1] = 0  # a dead group
    ref = torch.stack([dense[a]["down"].double() @ h.double().cpu()[a] for a in range(A)])
    for skip in (False, True):
        part, live = down_relaid(bank, offs, h, lay, skip=skip, f16x2=True)
        assert rel_err(part.sum(1).cpu().double() / scale, ref / scale) < 3e-3
        assert torch.equal(live, down_relaid(bank, offs, h, lay, skip=skip)[1])
    real = dec.h_pairs
    try:
        for wrong in (lambda q: (q << 16) | ((q >> 16) & 0xFFFF),  # the pair's halves exchanged
                      lambda q: q.view(A, -1, 8).roll(1, dims=1).reshape(A, -1)):  # each group's activations another group's
            dec.h_pairs = lambda v, fp8=False, wrong=wrong: (lambda q, inv: (wrong(q).contiguous(), inv))(*real(v, fp8))
            part, _ = down_relaid(bank, offs, h, lay, skip=False, f16x2=True)
            assert rel_err(part.sum(1).cpu().double() / scale, ref / scale) > 0.2
    finally:
        dec.h_pairs = real


def test_bench_reads_the_bytes_alone():
    """`bench kernels`' bytes-alone ceiling reads exactly the first n bytes of each block: each program's xor is the
    xor of its words, so a byte out of place changes it."""
    import numpy as np

    from sluice.benchmarks.kernels import read_bytes

    bank = torch.randint(0, 256, (3 * 8192,), dtype=torch.uint8, device=DEVICE)
    offs = torch.tensor([16384, 0, 8192], dtype=torch.int64, device=DEVICE)
    n = 1000 * 8  # not a whole number of 512-word programs
    got = read_bytes(bank, offs, n, bw=512).cpu()
    for a, o in enumerate(offs.tolist()):
        words = bank[o: o + n].cpu().view(torch.int64).numpy()
        want = [np.bitwise_xor.reduce(words[p: p + 512]) for p in (0, 512)]
        assert got[a].tolist() == [int(w) for w in want], a
    bank[16384 + n - 1] ^= 1  # the last byte read of the first block
    assert int(read_bytes(bank, offs, n, bw=512)[0, 1]) != int(got[0, 1])


@pytest.mark.parametrize("kind,fmt", [("relu2", "nvfp4"), ("swiglu", "nvfp4"), ("swiglu", "bf16")])
def test_planned_groups_equal_each_group_run_alone(kind, fmt):
    """A prompt layer's groups planned once (one copy of every group's tiles, shared rows: `plan_groups`) give the same
    y, bit for bit, as each group run alone (`run`); tiles planned one expert off fail."""
    from sluice.kernels.experts import TritonExperts

    A, K, T, Dx, I = 6, 2, 40, 64, 96
    bank, offs, manifest, _ = make_bank(kind, fmt, A, Dx, I, seed=11)
    bank, offs = bank.to(DEVICE), offs.to(DEVICE)
    kern = TritonExperts(manifest, kind, "relu2" if kind == "relu2" else "silu", torch.device(DEVICE))
    g = torch.Generator().manual_seed(2)
    favour = torch.tensor([8.0, 4.0, 1.0, 1.0, 0.3, 0.3])  # skewed: experts of several row tiles, groups of other BMs
    ids = torch.stack([torch.multinomial(favour, K, generator=g) for _ in range(T)])  # [T, K] distinct experts a row
    flat = ids.flatten()
    order = [3, 0, 5, 1, 4, 2]  # the layer's offsets' order: VRAM, then RAM groups
    rank = torch.zeros(A, dtype=torch.int64)
    rank[order] = torch.arange(A)
    rows = torch.argsort(rank[flat], stable=True).to(DEVICE)
    counts = torch.bincount(flat, minlength=A).tolist()
    xe = torch.randn(T, Dx, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.rand(T * K, generator=g).to(DEVICE)
    lay_offs = offs[torch.tensor(order, device=DEVICE)]
    groups = [order[:2], order[2:5], order[5:]]

    def alone():
        y, at = torch.zeros(T * K, Dx, dtype=torch.bfloat16, device=DEVICE), [0, 0]
        for grp in groups:
            c = [counts[e] for e in grp]
            o = lay_offs[at[0] : at[0] + len(grp)]
            kern.run(bank, o, bank, o, c, rows[at[1] : at[1] + sum(c)], K, xe, w, y, False)
            at[0], at[1] = at[0] + len(grp), at[1] + sum(c)
        return y

    def planned(shift: int = 0):
        y = torch.zeros(T * K, Dx, dtype=torch.bfloat16, device=DEVICE)
        p = kern.plan_groups([[counts[e] for e in grp] for grp in groups], rows, K, xe, w)
        if shift:  # each tile's expert index one off (within the layer's offsets): a wrong block read for its rows
            items = p.items.clone()
            items[:, 0] = (items[:, 0] + shift) % A
            p = dataclasses.replace(p, items=items)
        for i in range(len(groups)):
            kern.run_group(p, i, bank, lay_offs, bank, lay_offs, xe, y)
        return y

    assert len({kern.tile_rows(max(counts[e] for e in grp)) for grp in groups}) > 1 and max(counts) > 16
    want = alone()
    assert torch.equal(planned(), want)
    assert not torch.equal(planned(shift=1), want)
