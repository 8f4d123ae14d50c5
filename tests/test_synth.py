"""`sluice synth`: synthetic checkpoints with real models' tensor shapes."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.errors import ConfigError
from sluice.storage import synth as synth_mod
from sluice.storage.plan import plan
from sluice.storage.repack import repack
from sluice.storage.verify import verify

GiB = 2**30


def test_super_shape_headers(tmp_path):
    out = synth_mod.synth("nemotron-3.5-super", "nvfp4", tmp_path / "super", headers_only=True, progress=False)
    p = plan(out, vram=8 * GiB, ram=64 * GiB)
    assert (p.moe_layers, p.num_experts, p.top_k) == (40, 512, 22)
    assert 3_096_576 < p.block_bytes <= 3_096_576 + 4096  # up 2688x1024 + down 1024x2688 in NVFP4, 4 KiB-rounded
    assert 2.72e9 < p.expert_bytes_per_token < 2.73e9  # 22 x 40 blocks: the reference system's 2.7 GB per token
    from transformers import AutoConfig

    types = AutoConfig.from_pretrained(out).layers_block_type
    assert (types.count("linear_attention"), types.count("moe"), types.count("full_attention")) == (40, 40, 8)


def test_slice_keeps_the_first_moe_layers(tmp_path):
    out = synth_mod.synth("nemotron-3-nano-30b-a3b", "fp8", tmp_path / "nano", moe_layers=3, headers_only=True, progress=False)
    p = plan(out, vram=8 * GiB, ram=8 * GiB)
    assert p.moe_layers == 3 and p.tiers["fp8_block"] > 0
    with pytest.raises(ConfigError, match="has 23 MoE layers"):
        synth_mod.synth("nemotron-3-nano-30b-a3b", "fp8", tmp_path / "x", moe_layers=99, headers_only=True)
    with pytest.raises(ConfigError, match="unknown 'gpt-9'"):
        synth_mod.synth("gpt-9", "nvfp4", tmp_path / "y")


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_written_checkpoint_runs(tmp_path, monkeypatch, fmt):
    """A small shape written for real: it repacks, verifies and runs to finite logits."""
    monkeypatch.setitem(synth_mod.SHAPES, "tiny", ("nemotron_h", dict(
        hybrid_override_pattern="ME*E", hidden_size=64, moe_latent_size=32, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)))
    out = synth_mod.synth("tiny", fmt, tmp_path / "ck", progress=False)
    store = repack(out, tmp_path / "store", progress=False)
    assert verify(store.path, progress=False) == []
    with sluice.load(store.path, device="cpu") as engine:
        logits = engine.forward([1, 2, 3, 4])
    assert torch.isfinite(logits).all() and logits.shape == (4, 128)


SMALL = ("nemotron_h", dict(synth_mod.NEMOTRON_COMMON, hybrid_override_pattern="MEM*EME", hidden_size=256, n_routed_experts=64,
                            num_experts_per_tok=6, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
                            mamba_num_heads=8, mamba_head_dim=32, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            vocab_size=512, n_groups=2))


def test_routing_depends_on_the_token(tmp_path, monkeypatch):
    """A synthetic checkpoint routes as a model whose routing follows its tokens: over a prompt and 32 greedy decode
    tokens each MoE layer touches at least 70% of the distinct experts uniform routing would, and consecutive decode
    tokens share about as many experts as uniform routing predicts (K^2 / E), not the same few every token."""
    from sluice.storage.trace import read_trace

    monkeypatch.setitem(synth_mod.SHAPES, "small", SMALL)
    store = repack(synth_mod.synth("small", "bf16", tmp_path / "ck", progress=False), tmp_path / "store", progress=False)
    E, K, P = 64, 6, 16
    with sluice.load(store.path, device="cpu", record_routing=str(tmp_path / "r.jsonl")) as engine:
        engine.generate(torch.randint(3, 512, (P,), generator=torch.Generator().manual_seed(0)).tolist(), 32)
    records = read_trace(tmp_path / "r.jsonl").records
    for layer in sorted({r.layer for r in records}):
        tokens = [set(r.ids[t * K : (t + 1) * K]) for r in records if r.layer == layer for t in range(r.tokens)]
        uniform = E * (1 - (1 - K / E) ** len(tokens))
        assert len(set().union(*tokens)) >= 0.7 * uniform, f"layer {layer}"
        shared = [len(a & b) for a, b in zip(tokens[P:], tokens[P + 1 :])]
        assert sum(shared) / len(shared) <= K * K / E + 1.0, f"layer {layer}: {shared}"


def test_layers_and_experts_are_distinct(tmp_path, monkeypatch):
    """Every MoE layer's router, correction bias and every expert are tensors of their own; norms are near 1."""
    monkeypatch.setitem(synth_mod.SHAPES, "small", SMALL)
    _, plan = synth_mod.tensor_plan("small", "nvfp4")
    made = {name: make() for name, _, _, make in plan}
    routers = [t for n, t in made.items() if n.endswith("gate.weight")]
    biases = [t for n, t in made.items() if n.endswith("e_score_correction_bias")]
    assert len(routers) == len(biases) == 3
    for group in (routers, biases):
        assert all(not torch.equal(a, b) for i, a in enumerate(group) for b in group[i + 1 :])
    assert max(float(b.abs().max()) for b in biases) < 0.2  # beside sigmoid scores spread over ~(0.2, 0.8)
    ups = [t for n, t in made.items() if ".experts." in n and n.endswith("up_proj.weight")]
    assert len(ups) == 3 * 64 and len({t.numpy().tobytes() for t in ups}) == len(ups)
    norms = [t.float() for n, t in made.items() if n.endswith("norm.weight") or n.endswith("norm_f.weight")]
    assert norms and all(0.9 < float(t.mean()) < 1.1 for t in norms)
