"""The fused small ops of a one-token step (kernels/norm.py, kernels/router.py) against their plain-torch references,
and a Nemotron-H with them in place (`fused_ops`) against transformers. Triton runs interpreted on a CPU."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.kernels.norm import rms_norm, rms_norm_ref
from sluice.kernels.router import router_ref, sigmoid_router
from common import DEVICE
from test_golden import check_golden


@pytest.mark.parametrize("rows,D,dtype", [(1, 2688, torch.bfloat16), (3, 37, torch.float32), (2, 300, torch.float16),
                                          (4, 64, torch.float32)])
def test_rms_norm_matches_its_reference(rows, D, dtype):
    """Shapes and dtype kept; fp32 outputs within a few ulps, 16-bit ones within one rounding of the output type."""
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(rows, D, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(D, generator=g).to(dtype).to(DEVICE)
    got, want = rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert got.shape == want.shape == (rows, D) and got.dtype == dtype
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1)
    assert bool(((got.float() - want.float()).abs() <= 2 * ulp).all())
    assert not torch.allclose(rms_norm(x, w.flip(0), 1e-5).float(), want.float(), atol=1e-2)  # a wrong weight shows


@pytest.mark.parametrize("T,D,E,K", [(1, 2688, 128, 6), (5, 100, 40, 3), (2, 64, 16, 16), (20, 64, 16, 4)])
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


def test_fused_nemotron_h_matches_transformers(stores, refs):
    """`fused_ops`: every RMSNorm and router of a Nemotron-H replaced by the kernels; the prompt's and every decode
    step's logits within the golden tolerance, the greedy tokens the reference's."""
    with sluice.load(stores["nemotron_h"], device=DEVICE, fused_ops=True, schedule="direct") as engine:
        names = {type(m).__name__ for m in engine.model.hf.modules()}
        assert "RMSNorm" in names and "NemotronHRMSNorm" not in names
        check_golden(engine, "nemotron_h", refs, "nemotron_h fused ops")
