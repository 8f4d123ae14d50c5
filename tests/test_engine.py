"""The Python API: load, forward, generate, stream, sampling, settings, traces."""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from sluice.errors import ConfigError, SluiceError, StoreError
from sluice.pipeline.config import parse_size
from sluice.pipeline.sampling import Sampler
from sluice.stages import STAGES
from tests.common import DEVICE, PROMPT


def test_checkpoint_path_is_repacked_once(checkpoints):
    with sluice.load(checkpoints["qwen3_moe"], device=DEVICE, progress=False) as a:
        first = a.store.path
        logits = a.forward(PROMPT)
    mtime = (first / "manifest.json").stat().st_mtime_ns
    with sluice.load(checkpoints["qwen3_moe"], device=DEVICE, progress=False) as b:
        assert b.store.path == first and torch.equal(b.forward(PROMPT), logits)
    assert (first / "manifest.json").stat().st_mtime_ns == mtime


def test_stream_equals_generate_and_sampling_is_seeded(stores):
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        assert list(engine.stream(PROMPT, 10)) == engine.generate(PROMPT, 10)
        a = engine.generate(PROMPT, 12, temperature=0.8, top_p=0.9, seed=7)
        b = engine.generate(PROMPT, 12, temperature=0.8, top_p=0.9, seed=7)
        c = engine.generate(PROMPT, 12, temperature=5.0, seed=8)
        assert a == b and len(a) == 12 and a != c
        assert engine.generate(PROMPT, 5, stop_ids=(engine.generate(PROMPT, 1)[0],)) == engine.generate(PROMPT, 1)


def test_extend_continues_a_sequence_like_one_long_prompt(stores):
    with sluice.load(stores["qwen3_moe"], device=DEVICE) as engine:
        whole = engine.forward(PROMPT)
        seq = engine.new_sequence()
        engine.extend(seq, PROMPT[:5])
        tail = engine.extend(seq, PROMPT[5:]).cpu()
        assert seq.tokens == PROMPT
        assert (tail - whole[5:]).abs().max() < 1e-5


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([3.0, 2.9, -5.0, -6.0])
    s = Sampler(temperature=1.0, top_p=0.5, seed=0)
    assert {s(logits) for _ in range(50)} <= {0, 1}
    assert Sampler(0.0)(logits) == 0
    with pytest.raises(SluiceError, match="top_p"):
        Sampler(1.0, top_p=0.0)


def test_bad_settings_are_named(stores, tmp_path):
    with pytest.raises(ConfigError, match="ram_cache: cannot read 'lots'"):
        sluice.load(stores["qwen3_moe"], ram_cache="lots")
    with pytest.raises(ConfigError, match="device: 'gpu'"):
        sluice.load(stores["qwen3_moe"], device="gpu")
    with pytest.raises(StoreError, match="neither an expert store"):
        sluice.load(tmp_path)
    with sluice.load(stores["qwen3_moe"], device=DEVICE) as engine:
        with pytest.raises(SluiceError, match="empty"):
            engine.generate([], 3)
    assert parse_size("1.5GiB", "x") == 1536 * 1024**2 and parse_size("512MB", "x") == 512 * 10**6


def test_trace_files(stores, tmp_path):
    trace = tmp_path / "t.json"
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, trace=str(trace), ram_cache="64KiB") as engine:
        engine.generate(PROMPT, 3)
        summary = engine.rt.tracer.summary()
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert names == set(STAGES)  # span names are the stage file names
    assert {e["tid"] for e in events if e.get("ph") == "X" and e["pid"] == 1} == {f"host/{n}" for n in STAGES}
    assert any(e["name"] == "read" and e["ph"] == "b" for e in events)
    lines = [json.loads(l) for l in (tmp_path / "t.json.jsonl").read_text().splitlines()]
    host = [l for l in lines if l["event"] == "stage"]
    assert {l["stage"] for l in host} == set(STAGES) and all(l["host_us"] >= 0 for l in host)
    assert all(l["gpu_us"] >= 0 for l in lines if l["event"] == "gpu")  # CUDA only
    n_moe = 3
    assert summary["route"]["count"] == 3 * n_moe  # 3 steps x 3 MoE layers


def test_snapshot_restores_exactly(stores):
    """A restored snapshot continues bit-identically to the sequence it was taken from."""
    # Mamba, KV, DeltaNet, MLA states; DeepSeek-V4's sliding window, compressor buffers and compressed entries
    for variant in ("nemotron_h_latent", "qwen3_moe", "qwen3_next", "deepseek_v3", "deepseek_v4"):
        with sluice.load(stores[variant], device=DEVICE) as engine:
            seq = engine.new_sequence()
            engine.extend(seq, PROMPT)
            snap = engine.snapshot(seq)
            assert snap.nbytes > 0 and snap.tokens == tuple(PROMPT)
            live = engine.extend(seq, [7, 8, 9]).cpu()
            again = engine.restore(snap)
            assert torch.equal(engine.extend(again, [7, 8, 9]).cpu(), live)
            other = engine.restore(snap)  # the snapshot is reusable after a restore ran on
            assert torch.equal(engine.extend(other, [7, 8, 9]).cpu(), live)


def test_bench_model_reports_io(stores):
    from sluice.pipeline.bench import bench_model, format_bench

    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        r = bench_model(engine, prompt_lengths=(8,), decode_tokens=4)
        text = format_bench(r, engine.store.block_bytes)
    d = r["decode"]
    assert r["prefill"][8]["tok_s"] > 0 and d["tokens"] == 4 and d["tok_s"] > 0
    assert sum(d["blocks_per_token"].values()) == 3 * 4  # 3 MoE layers x top-4, every decode step
    assert "decode:" in text and "hit rate" in text
