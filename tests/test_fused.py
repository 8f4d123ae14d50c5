"""The fused small ops of a one-token step (kernels/norm.py, kernels/router.py, kernels/gemv.py, kernels/add.py,
kernels/kv_append.py, kernels/attention.py) against their plain-torch references,
and a Nemotron-H with them in place (`fused_ops`) against transformers. Triton runs interpreted on a CPU."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.kernels.add import add3, residual_add, residual_add_ref
from sluice.kernels.attention import fits, one_query_attention, one_query_attention_ref
from sluice.kernels.gemv import Gemv, gemv, gemv_ref, linear_add
from sluice.kernels.kv_append import appendable, kv_append, kv_append_ref
from sluice.kernels.norm import rms_norm, rms_norm_ref
from sluice.kernels.router import router_ref, sigmoid_router
from common import DEVICE
from test_golden import check_golden


@pytest.mark.parametrize("rows,D,dtype,w_dtype", [(1, 2688, torch.bfloat16, None), (3, 37, torch.float32, None),
                                                  (2, 300, torch.float16, None), (4, 64, torch.float32, None),
                                                  (2, 128, torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("round_first", [False, True])
def test_rms_norm_matches_its_reference(rows, D, dtype, w_dtype, round_first):
    """Shapes kept, the dtype the formula gives (Llama's form, `round_first`: the promotion of x's and the weight's);
    fp32 outputs within a few ulps, 16-bit ones within one rounding of the output type. The two forms differ in
    16 bits (the must-fail side)."""
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(rows, D, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(D, generator=g).to(w_dtype or dtype).to(DEVICE)
    got, want = rms_norm(x, w, 1e-5, round_first), rms_norm_ref(x, w, 1e-5, round_first)
    assert got.shape == want.shape == (rows, D) and got.dtype == want.dtype
    assert got.dtype == (torch.promote_types(dtype, w.dtype) if round_first else dtype)
    eps = max(torch.finfo(got.dtype).eps, torch.finfo(dtype).eps if round_first else 0)  # the row rounded to x's dtype first
    ulp = eps * want.float().abs().clamp(min=1)
    assert bool(((got.float() - want.float()).abs() <= 2 * ulp).all())
    if DEVICE == "cuda" and got.dtype != torch.float32:  # rounding to nearest, as torch: equal but where the row's sum
        assert (got == want).float().mean().item() >= 0.95  # order moves a 16-bit rounding (fp32 outputs: any last bit)
    assert not torch.allclose(rms_norm(x, w.flip(0), 1e-5, round_first).float(), want.float(), atol=1e-2)  # a wrong weight shows
    if dtype != torch.float32 and w_dtype is None:
        other = rms_norm(x, w, 1e-5, not round_first)
        assert not torch.equal(other, want)


@pytest.mark.parametrize("shape,dtype", [((1, 1, 2688), torch.bfloat16), ((1, 3, 70), torch.float16), ((1, 2, 1500), torch.float32)])
def test_add3_is_torchs_two_adds(shape, dtype):
    """residual + (out + shared) in one launch, bit for bit torch's two adds (each rounded); the sum rounded once (the
    three added in fp32) differs (the must-fail side); without a shared term it is torch's one add."""
    g = torch.Generator().manual_seed(shape[-1])
    r, a, b = ((torch.randn(*shape, generator=g) * s).to(dtype).to(DEVICE) for s in (8, 1, 1e-2))
    want = residual_add_ref(r, a.view(-1, shape[-1]), b.view(-1, shape[-1]))
    got = add3(r, a, b)
    assert got.shape == r.shape and got.dtype == dtype and torch.equal(got, want)
    if dtype != torch.float32:
        assert not torch.equal(got, (r.float() + a.float() + b.float()).to(dtype))
    assert torch.equal(residual_add(r, a, None), r + a)


@pytest.mark.parametrize("H,S,DK,DV,dtype", [(2, 16, 128, 128, torch.bfloat16), (3, 7, 24, 40, torch.float32)])
def test_kv_append_is_transformers_update(H, S, DK, DV, dtype):
    """A token's key and value (strided as attention makes them) written at the cache's length and the length moved
    on: the same cache as transformers' five ops, step after step; at a full cache nothing is written."""
    g = torch.Generator().manual_seed(H * S)
    caches = [[torch.zeros(1, H, S, d, dtype=dtype, device=DEVICE) for d in (DK, DV)] + [torch.zeros((), dtype=torch.int64, device=DEVICE)]
              for _ in range(2)]
    for _ in range(S):
        k = torch.randn(1, 1, H, DK, generator=g).to(dtype).to(DEVICE).transpose(1, 2)  # [1,H,1,Dk], heads strided
        v = torch.randn(1, 1, H, DV, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        assert appendable(caches[0][0], caches[0][1], k, v)
        kv_append(*caches[0][:2], k, v, caches[0][2])
        kv_append_ref(*caches[1][:2], k, v, caches[1][2])
        assert all(torch.equal(x, y) for x, y in zip(caches[0], caches[1]))
    assert int(caches[0][2]) == S and bool(caches[0][0][:, :, -1].abs().sum() > 0)
    full = [t.clone() for t in caches[0][:2]]
    kv_append(*caches[0][:2], k * 2, v * 2, caches[0][2])
    assert all(torch.equal(x, y) for x, y in zip(caches[0][:2], full)) and int(caches[0][2]) == S + 1
    assert not appendable(caches[0][0], caches[0][1], torch.cat([k, k], dim=2), v)  # two tokens: transformers' update


@pytest.mark.parametrize("Hq,Hk,W,D,dtype", [(32, 2, 256, 128, torch.bfloat16), (6, 3, 70, 40, torch.float32),
                                              (4, 4, 9, 16, torch.float16)])
def test_one_query_attention_matches_its_reference(Hq, Hk, W, D, dtype):
    """One query row per head over its KV head's slots (strided, as a static cache's window is), masked or not: within
    one rounding of the output dtype of the reference; SDPA itself agrees; the mask ignored (attending empty slots)
    differs (the must-fail side)."""
    g = torch.Generator().manual_seed(W)
    q = torch.randn(1, 1, Hq, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)  # [1, Hq, 1, D], heads strided
    cache_k, cache_v = (torch.randn(1, Hk, W + 30, D, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    k, v = cache_k[:, :, :W], cache_v[:, :, :W]
    mask = torch.zeros(1, 1, 1, W, dtype=torch.bool, device=DEVICE)
    mask[..., : W // 2 + 1] = True
    scale = D ** -0.5
    for m in (mask, None):
        assert fits(q, k, v, m)
        got, want = one_query_attention(q, k, v, m, scale), one_query_attention_ref(q, k, v, m, scale)
        assert got.shape == want.shape == (1, 1, Hq, D) and got.dtype == dtype
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=2 ** -4)
        assert bool(((got.float() - want.float()).abs() <= 2 * ulp + 1e-6).all())
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.repeat_interleave(Hq // Hk, 1).float(), v.repeat_interleave(Hq // Hk, 1).float(), attn_mask=mask, scale=scale)
    assert torch.allclose(one_query_attention(q, k, v, mask, scale).float(), sdpa.transpose(1, 2), atol=4 * torch.finfo(dtype).eps)
    masked = one_query_attention_ref(q, k, v, mask, scale)
    assert not torch.allclose(one_query_attention(q, k, v, None, scale).float(), masked.float(), atol=1e-2)
    assert not fits(torch.cat([q, q], dim=2), k, v, mask)  # two query rows: SDPA's


@pytest.mark.parametrize("T,D,E,K", [(1, 2688, 128, 6), (5, 100, 40, 3), (2, 64, 16, 16), (20, 64, 16, 4), (1, 5000, 8, 2)])
def test_router_matches_its_reference(T, D, E, K):
    """The same ids best first, their weights within fp32 rounding; a bias that favours one expert routes every
    row to it first; without the bias the choice changes (the must-fail side)."""
    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)
    weight, bias = (torch.randn(E, D, generator=g) * 0.05).to(DEVICE), (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    (w, ids), (w_ref, ids_ref) = sigmoid_router(x, weight, bias, K, 2.5, True), router_ref(x, weight, bias, K, 2.5, True)
    assert w.shape == ids.shape == (T, K) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(w.sum(-1), torch.full((T,), 2.5, device=DEVICE), rtol=1e-6)
    favoured = bias.clone()
    favoured[E - 1] = 100.0
    assert bool((sigmoid_router(x, weight, favoured, K, 2.5, True)[1][:, 0] == E - 1).all())
    if K < E:
        assert not torch.equal(sigmoid_router(x, weight, torch.zeros_like(bias) - bias * 50, K, 2.5, True)[1], ids)


# on a CPU (the programs interpreted) 38 and 34 rows for 262 and 130: the same ragged edges at every tile
@pytest.mark.parametrize("N,K,dtype,bias", [(38 if DEVICE == "cpu" else 262, 520, torch.bfloat16, False), (37, 300, torch.float32, True),
                                             (34 if DEVICE == "cpu" else 130, 70, torch.float16, False), (5, 1000, torch.bfloat16, True)])
def test_gemv_matches_its_reference(N, K, dtype, bias):
    """One row through the one-launch linear: within one rounding of the output type of the fp32 reference (fp32: of its
    sum's order), at tiles
    that leave ragged edges in N and K too; the module takes longer inputs through F.linear; a transposed read of the
    weight's rows (one output's row for another's) shows."""
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    want = gemv_ref(x, w, b)
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1) + (1e-6 if dtype == torch.float32 else 0)
    for bn, bk in [(0, 0), (4, 64), (16, 128)]:
        got = gemv(x, w, b, bn=bn, bk=bk)
        assert got.shape == (N,) and got.dtype == dtype
        assert bool(((got.float() - want.float()).abs() <= 2 * ulp).all()), (bn, bk)
    lin = torch.nn.Linear(K, N, bias=bias, dtype=dtype, device=DEVICE)
    lin.weight.data.copy_(w)
    if bias:
        lin.bias.data.copy_(b)
    assert torch.equal(Gemv(lin)(x.view(1, 1, K)).view(N), gemv(x, w, b))
    rows = torch.randn(3, K, generator=g).to(dtype).to(DEVICE)
    assert torch.equal(Gemv(lin)(rows), torch.nn.functional.linear(rows, w, b))
    assert not torch.allclose(gemv(x, w.flip(0), b).float(), want.float(), atol=1e-2)
    wide = torch.cat([w, torch.randn(N, 16, generator=g).to(dtype).to(DEVICE)], dim=1)[:, :K]  # rows K + 16 apart
    assert torch.equal(gemv(x, wide, b), gemv(x, w, b))
    # the epilogues: bit for bit torch's ops on the GEMV's output, and the reference's
    y, r = gemv(x, w, b), torch.randn(N, generator=g).to(dtype).to(DEVICE)
    assert torch.equal(gemv(x, w, b, relu2=True), torch.square(torch.relu(y)))
    assert torch.equal(gemv(x, w, b, residual=r), r + y)
    assert torch.equal(linear_add(Gemv(lin), x.view(1, 1, K), r.view(1, 1, N)).view(N), r + y)
    assert not torch.equal(gemv(x, w, b, relu2=True, residual=r), r + y)  # relu^2 applied shows
    ref = gemv_ref(x, w, b, relu2=True, residual=r)
    assert bool(((gemv(x, w, b, relu2=True, residual=r).float() - ref.float()).abs() <= 4 * ulp * (1 + y.float().abs())).all())


def test_relu2_mlp_is_the_module_it_replaces():
    """A shared expert's up -> relu^2 -> down with the activation in the up GEMV's launch: one row bit for bit the MLP
    over the same GEMVs; longer inputs through the module's own path."""
    from types import SimpleNamespace

    from transformers.activations import ReLUSquaredActivation

    from sluice.kernels.gemv import Relu2MLP

    g = torch.Generator().manual_seed(3)
    up, down = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)
    mlp = SimpleNamespace(up_proj=Gemv(up.to(DEVICE)), down_proj=Gemv(down.to(DEVICE)), act_fn=ReLUSquaredActivation())
    fused = Relu2MLP(mlp)
    for x in (torch.randn(1, 1, 64, generator=g).to(DEVICE), torch.randn(1, 5, 64, generator=g).to(DEVICE)):
        want = mlp.down_proj(mlp.act_fn(mlp.up_proj(x)))
        assert torch.equal(fused(x), want)


@pytest.mark.parametrize("static_kv", [pytest.param(None, marks=pytest.mark.slow), 64])  # CI: the static cache (CUDA's default)
def test_fused_nemotron_h_matches_transformers(static_kv, stores, refs, monkeypatch):
    """`fused_ops`, `fused_linears` and `fused_mamba`: every RMSNorm, router, linear, shared expert, Mamba step and
    one-token attention (kernels/attention.py, here interpreted: on a CPU it otherwise leaves it to SDPA; over a static
    cache's window, masked, or a growing cache) of a Nemotron-H through the kernels; the prompt's and every decode
    step's logits within the golden tolerance, the greedy tokens the reference's."""
    from sluice.models import one_query

    ran, kernel = [], one_query.one_query_attention
    monkeypatch.setattr(one_query, "_runs_here", lambda q: True)
    monkeypatch.setattr(one_query, "one_query_attention",
                        lambda q, k, v, m, s: ran.append(m is not None) or kernel(q, k, v, m, s))
    with sluice.load(stores["nemotron_h"], device=DEVICE, fused_ops=True, fused_linears=True, fused_mamba=True,
                     schedule="direct", static_kv=static_kv) as engine:  # the Mamba step's residual add in its out_proj's too
        names = {type(m).__name__ for m in engine.model.hf.modules()}
        assert {"RMSNorm", "Gemv", "Relu2MLP"} <= names and not names & {"NemotronHRMSNorm", "Linear", "NemotronHMLP"}
        # the same kernels each step: 8 of them (4 on a CPU, each ~3 s interpreted)
        check_golden(engine, "nemotron_h", refs, "nemotron_h fused ops", n=8 if DEVICE != "cpu" else 4)
    # one-token steps' attention through the kernel, masked over a static cache's window (a growing cache's mask is
    # transformers' choice: None on a CPU, a mask on CUDA; either way through the kernel)
    assert ran and (static_kv is None or all(ran))


def test_fused_linears_reach_the_moe_blocks_linears(stores, monkeypatch):
    """`fused_linears` replaces the linears a MoE block calls too (a latent MoE's input projection, the shared
    expert's), not only those the module tree holds: a one-row call of each goes through the GEMV."""
    from sluice.kernels import gemv as gemv_module

    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, fused_linears=True, schedule="direct") as engine:
        block = next(layer.moe for layer in engine.model.layers if layer.moe is not None)
        calls = []
        monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a[1].shape) or gemv_ref(*a[:3]))
        x = torch.randn(1, engine.model.config.hidden_size).to(engine.model.dtype).to(DEVICE)
        block.expert_input(x)
        assert len(calls) == 1
        block.shared(x)
        assert len(calls) == 3  # the shared expert's up and down


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss_unquantized", "deepseek_v4",
                                     pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_fused_decoder_models_match_transformers(variant, stores, refs, monkeypatch):
    """`fused_ops` on the attention-and-MoE decoders: each RMSNorm of a form the kernel has (models/decoder.py
    `NORM_FORMS`) through kernels/norm.py, each one-token attention whose shapes fit through kernels/attention.py (here
    interpreted), Qwen3-MoE's and Mixtral's softmax routers through kernels/router.py and their attentions' norms and
    rotation through kernels/rope.py, a static cache's window masked (DeepSeek-V4: a growing cache); the prompt's and every decode step's logits within the golden
    tolerance, the greedy tokens the reference's."""
    from sluice.models import norm_rope, one_query
    from sluice.models.decoder import NORM_FORMS

    from sluice.kernels import router

    ran, kernel, routed, route = [], one_query.one_query_attention, [], router.softmax_router
    rotated, rotate = [], norm_rope.norm_rope
    monkeypatch.setattr(one_query, "_runs_here", lambda q: True)
    monkeypatch.setattr(one_query, "one_query_attention", lambda q, k, v, m, s: ran.append(1) or kernel(q, k, v, m, s))
    monkeypatch.setattr(router, "softmax_router", lambda *a: routed.append(1) or route(*a))
    monkeypatch.setattr(norm_rope, "norm_rope", lambda *a: rotated.append(1) or rotate(*a))
    if variant == "deepseek_v4" and DEVICE.startswith("cuda"):
        pytest.skip("its decode logits drift from transformers' on CUDA under every schedule, fused or not "
                    "(docs/compiled-plan.md, Left 7)")
    static_kv = None if variant == "deepseek_v4" else 64  # its compressed attention has no static layer
    with sluice.load(stores[variant], device=DEVICE, fused_ops=True, schedule="direct", static_kv=static_kv) as engine:
        names = {type(m).__name__ for m in engine.model.hf.modules()}
        parts = [getattr(layer, "parts", False) for layer in engine.model.layers]
        assert not names & set(NORM_FORMS)
        swapped = "RMSNorm" in names
        check_golden(engine, variant, refs, f"{variant} fused ops", n=8)
    assert swapped or variant == "qwen3_next"  # its (1 + weight) norms stay transformers'
    assert ran or variant in ("deepseek_v3", "gpt_oss_unquantized", "deepseek_v4")  # MLA's widths, attention sinks
    assert bool(routed) == (variant in ("qwen3_moe", "mixtral"))  # their softmax routers in kernels/router.py
    assert bool(rotated) == (variant in ("qwen3_moe", "mixtral"))  # their norms and rotation in kernels/rope.py
    assert any(parts) == (variant in ("qwen3_moe", "mixtral"))  # their sparse layers' MoE inputs from the layers' parts


@pytest.mark.parametrize("T,D,E,K,dtype,norm,out", [(1, 2048, 128, 8, torch.bfloat16, True, torch.bfloat16),
                                                    (3, 40, 8, 2, torch.float32, True, torch.float32),
                                                    (2, 64, 60, 4, torch.bfloat16, False, torch.float32)])
def test_softmax_router_matches_its_reference(T, D, E, K, dtype, norm, out):
    """The same experts best first and their weights within rounding of the output dtype (the logits rounded to the
    router's dtype, the softmax in fp32); a row of other weights routes elsewhere (the must-fail side)."""
    from sluice.kernels.router import softmax_router, softmax_router_ref

    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, D, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(E, D, generator=g) / D ** 0.5 * 4).to(dtype).to(DEVICE)
    (got_w, got_i), (want_w, want_i) = softmax_router(x, w, K, norm, out), softmax_router_ref(x, w, K, norm, out)
    assert got_w.dtype == want_w.dtype == out and got_i.dtype == torch.int64 and got_i.shape == (T, K)
    assert torch.equal(got_i, want_i)
    tol = 2 * torch.finfo(out).eps + (4 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6)
    assert torch.allclose(got_w.float(), want_w.float(), atol=tol, rtol=tol)
    if norm:
        assert torch.allclose(got_w.float().sum(-1), torch.ones(T, device=DEVICE), atol=K * torch.finfo(out).eps)
    assert not torch.equal(softmax_router(x, w.flip(0), K, norm, out)[1], want_i)


NORM_MODULES = {"Qwen3MoeRMSNorm": "qwen3_moe", "MixtralRMSNorm": "mixtral", "DeepseekV3RMSNorm": "deepseek_v3",
                "GptOssRMSNorm": "gpt_oss", "DeepseekV4RMSNorm": "deepseek_v4"}


@pytest.mark.parametrize("name", sorted(NORM_MODULES))
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_norm_forms_are_transformers_formulas(name, w_dtype):
    """Each transformers RMSNorm class that models/decoder.py `NORM_FORMS` swaps, on bf16 rows with a bf16 and an fp32
    weight, against the kernel with its form: the module's dtype, values within a rounding of it (Triton's interpreter
    rounds to bf16 by truncation: on a GPU they agree bit for bit but for the sum's order). With an fp32 weight the
    other form returns another dtype (the must-fail side: a wrong entry in NORM_FORMS shows)."""
    import importlib

    from sluice.kernels.norm import RMSNorm
    from sluice.models.decoder import NORM_FORMS

    assert set(NORM_FORMS) == set(NORM_MODULES)
    module = NORM_MODULES[name]
    norm = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)(96, eps=1e-6)
    g = torch.Generator().manual_seed(96)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    norm = norm.to(w_dtype).to(DEVICE)
    x = (torch.randn(3, 96, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    want, got = norm(x), RMSNorm(norm, NORM_FORMS[name])(x)
    assert got.dtype == want.dtype
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)
    if w_dtype == torch.float32:
        assert RMSNorm(norm, not NORM_FORMS[name])(x).dtype != want.dtype


@pytest.mark.parametrize("name", ["Qwen3MoeTopKRouter", "MixtralTopKRouter"])
def test_softmax_routers_are_transformers_routers(name):
    """Qwen3-MoE's and Mixtral's routers (models/decoder.py `SOFTMAX_ROUTERS`) on bf16 rows with bf16 weights, against
    the kernel's: the same experts best first, the weights in the router's dtype (Qwen3: the logits'; Mixtral: fp32)
    within a rounding of it."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from sluice.models.decoder import _softmax_router

    if name == "Qwen3MoeTopKRouter":
        gate = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True))
    else:
        gate = MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2))
    g = torch.Generator().manual_seed(64)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
    gate = gate.to(torch.bfloat16).to(DEVICE)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    (want_w, want_i), (got_w, got_i) = gate(x)[1:], _softmax_router(gate)(x)
    assert got_w.dtype == want_w.dtype and torch.equal(got_i, want_i)
    assert torch.allclose(got_w.float(), want_w.float(), rtol=2 ** -6, atol=1e-3)
