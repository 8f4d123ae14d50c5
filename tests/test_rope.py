"""An attention's per-head norms and rotary embedding in one launch (kernels/rope.py) against its plain-torch reference,
and the attention module that uses it (models/norm_rope.py) against transformers' own Qwen3-MoE and Mixtral attention
modules. Triton runs interpreted on a CPU."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels.rope import fits, norm_rope, norm_rope_ref
from common import DEVICE


def _inputs(T, Hq, Hk, D, dtype, norms, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, T, Hq * D, generator=g) * 3).to(dtype).to(DEVICE).view(1, T, Hq, D)  # a projection's rows
    k = (torch.randn(1, T, Hk * D, generator=g) * 3).to(dtype).to(DEVICE).view(1, T, Hk, D)
    ws = [torch.randn(D, generator=g).to(dtype).to(DEVICE) for _ in range(2)] if norms else [None, None]
    angle = (torch.arange(T) + 3).view(1, T, 1)  # not position 0: its sin is 0
    angle = angle * torch.rand(1, 1, D // 2, generator=g).repeat(1, 1, 2) * 3
    return q, k, *ws, angle.cos().to(dtype).to(DEVICE), angle.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("T,Hq,Hk,D,dtype,norms", [(1, 32, 4, 128, torch.bfloat16, True), (3, 4, 2, 16, torch.float32, True),
                                                   (2, 8, 2, 64, torch.bfloat16, False), (5, 3, 1, 40, torch.float16, True)])
def test_norm_rope_matches_its_reference(T, Hq, Hk, D, dtype, norms):
    """transformers' layout and dtype; without norms torch's ops bit for bit (each op rounded as torch rounds it),
    with them within a rounding of the dtype (the norm's sum adds in another order). A rotation the wrong way round
    (sin negated) and the norm's other form differ (the must-fail side)."""
    q, k, qw, kw, cos, sin = _inputs(T, Hq, Hk, D, dtype, norms, seed=T * D)
    assert fits(q, k, qw, kw, cos, sin, True)
    got, want = norm_rope(q, k, qw, kw, 1e-6, True, cos, sin), norm_rope_ref(q, k, qw, kw, 1e-6, True, cos, sin)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype == dtype
        if not norms:
            assert torch.equal(g_, w_)
        else:
            assert torch.allclose(g_.float(), w_.float(), rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
            if dtype == torch.bfloat16:  # the models' dtype: equal but where the sum's order moves a rounding
                assert (g_ == w_).float().mean().item() >= 0.9
    wrong = norm_rope(q, k, qw, kw, 1e-6, True, cos, -sin)
    assert not torch.allclose(wrong[0].float(), want[0].float(), atol=1e-2)
    if norms and dtype != torch.float32:
        qw32, kw32 = qw.float(), kw.float()
        assert norm_rope(q, k, qw32, kw32, 1e-6, True, cos.float(), sin.float())[0].dtype == torch.float32  # the promotion
        assert not torch.equal(norm_rope(q, k, qw, kw, 1e-6, False, cos, sin)[0], got[0])


def test_norm_rope_refuses_what_it_does_not_take():
    """Two sequences on the batch axis, a rotary table in another dtype, one norm without the other: the module's own
    ops run those."""
    q, k, qw, kw, cos, sin = _inputs(2, 4, 2, 16, torch.bfloat16, True, seed=1)
    assert fits(q, k, qw, kw, cos, sin, True)
    assert not fits(torch.cat([q, q]), torch.cat([k, k]), qw, kw, cos, sin, True)
    assert not fits(q, k, qw, kw, cos.float(), sin.float(), True)
    assert not fits(q, k, qw, None, cos, sin, True)


def _attention(name: str):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralAttention, MixtralRotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRotaryEmbedding

    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    if name == "Qwen3MoeAttention":
        config, attn, rotary = Qwen3MoeConfig(**kw), Qwen3MoeAttention, Qwen3MoeRotaryEmbedding
    else:
        config, attn, rotary = MixtralConfig(**kw), MixtralAttention, MixtralRotaryEmbedding
    config._attn_implementation = "sdpa"
    torch.manual_seed(5)
    module = attn(config, layer_idx=0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1 if p.dim() == 1 else 0))
    return config, module.to(torch.bfloat16).to(DEVICE).eval(), rotary(config).to(DEVICE)


@pytest.mark.parametrize("name", ["Qwen3MoeAttention", "MixtralAttention"])
def test_norm_rope_attention_is_transformers_attention(name):
    """The module in place of transformers' (models/norm_rope.py), both over their own growing caches: a 5-token prompt
    then 3 one-token steps give the same outputs, the three projections in one (Mixtral bit for bit; Qwen3-MoE within a bf16 rounding: its norms'
    sums) and the same cached keys; the kernel ran at each call; two sequences on the batch axis go through the module's own call, the residual added
    after it."""
    from transformers import DynamicCache

    from sluice.kernels import rope
    from sluice.models import norm_rope
    from sluice.models.base import cache_kw
    from sluice.models.norm_rope import NormRopeAttention

    config, module, rotary = _attention(name)
    fused = NormRopeAttention(module)
    assert fused.qkv is not None and module.q_proj.weight.data_ptr() == fused.qkv.weight.data_ptr()  # views: no memory added
    caches = [DynamicCache(config=config), DynamicCache(config=config)]
    ran, kernel = [], rope.norm_rope
    g = torch.Generator().manual_seed(7)
    pos = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norm_rope, "norm_rope", lambda *a: ran.append(1) or kernel(*a))
        for T in (5, 1, 1, 1):
            h = torch.randn(1, T, 64, generator=g).to(torch.bfloat16).to(DEVICE)
            ids = torch.arange(pos, pos + T, device=DEVICE).unsqueeze(0)
            pe = rotary(h, ids)
            mask = None if T == 1 else torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril().view(1, 1, T, T)
            with torch.no_grad():
                want = module(h, position_embeddings=pe, attention_mask=mask, **cache_kw(caches[0]))[0]
                got = fused(h, position_embeddings=pe, attention_mask=mask, **cache_kw(caches[1]))[0]
            assert got.dtype == want.dtype and got.shape == want.shape
            if name == "MixtralAttention":
                assert torch.equal(got, want)
            else:
                assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2e-2)
            pos += T
    assert len(ran) == 4
    h = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)  # two sequences: the module's own call
    r = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    pe = rotary(h, torch.arange(3, device=DEVICE).expand(2, 3))
    with torch.no_grad():
        want = module(h, position_embeddings=pe, attention_mask=None)[0]
        assert torch.equal(fused(h, position_embeddings=pe, attention_mask=None)[0], want)
        assert torch.equal(fused(h, position_embeddings=pe, attention_mask=None, residual=r)[0], r + want)
    assert len(ran) == 4
    k0, k1 = caches[0].layers[0].keys, caches[1].layers[0].keys
    assert k0.shape == k1.shape and torch.allclose(k0.float(), k1.float(), rtol=2 ** -6, atol=2e-2)
