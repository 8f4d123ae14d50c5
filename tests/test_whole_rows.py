"""A batched step of several sequences' decode tokens replayed whole as one graph (pipeline/whole.py `run_rows`)
against the same step run layer by layer (pipeline/batch.py): the same logits bit for bit at every step, the same
blocks tallied. On a CPU the body runs eagerly at each step (what a capture would take in: each sequence's position
read from a device tensor, its masks from its static cache, each MoE layer's rows as one composed step);
SLUICE_TEST_DEVICE=cuda captures and replays it."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.pipeline import whole as whole_mod
from sluice.pipeline.whole import WholeStep
from common import DEVICE
from test_batch import PROMPTS, STEPS, together
from test_direct import direct_schedule


def _run(store, schedule, whole: bool, routing: str | None = None):
    """Every sequence's logits over STEPS steps (the last STEPS - 1 batched), the blocks tallied, the engine's replays."""
    engine = sluice.load(store, device=DEVICE, schedule=schedule, static_kv=max(map(len, PROMPTS)) + STEPS + 4,
                         whole_step=whole, vram_slots=10, routing=routing)
    with engine:
        if whole and DEVICE == "cpu":  # no graphs on a CPU: the body itself, eagerly, at every replay
            engine.whole = WholeStep(engine.model, engine.coordinator, engine.rt, engine.routing, graphs=False)
        before = engine.rt.stats.snapshot()
        logits = together(engine, PROMPTS)
        replays = engine.whole.replays if engine.whole is not None else 0
        return logits, engine.rt.stats.since(before)["blocks"], replays


@pytest.mark.parametrize("variant,routing", [("nemotron_h", None),  # CI; a decoder model under drawn routing in test-all
                                             pytest.param("qwen3_moe", "uniform", marks=pytest.mark.slow)])
def test_a_batched_step_replayed_whole_gives_the_layer_by_layer_logits(variant, routing, stores, tmp_path):
    """From the second batched step on, the step replays whole over the three sequences' states: their logits bit for bit
    those of the step layer by layer, and the tier counted the same blocks."""
    schedule = direct_schedule(tmp_path, backend="triton", batch_rows="device", refresh=2)
    store = stores[variant]
    (want, want_blocks, _), (got, got_blocks, replays) = _run(store, schedule, False, routing), _run(store, schedule, True, routing)
    assert replays == STEPS - 2, "every batched step but the first over these states replays whole"
    for b, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{variant} sequence {b}: whole-step logits differ by {(g - w).abs().max()}"
    assert got_blocks == want_blocks, "the replays' tallies are the layer-by-layer steps'"


def test_rows_mixed_inside_the_whole_step_are_caught(stores, tmp_path, monkeypatch):
    """The check must fail: a whole step whose first resident layer hands each sequence another's rows gives other
    logits than the step layer by layer."""
    schedule = direct_schedule(tmp_path, backend="triton", batch_rows="device")
    want = _run(stores["nemotron_h"], schedule, False)[0]
    rows, calls = whole_mod.resident_rows, []

    def mixed(layer, hs, ctxs):
        out = rows(layer, hs, ctxs)
        calls.append(1)
        return out[::-1] if len(calls) == 1 else out
    monkeypatch.setattr(whole_mod, "resident_rows", mixed)
    got = _run(stores["nemotron_h"], schedule, True)[0]
    assert calls and not all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_step_out_of_vram_while_capturing_runs_layer_by_layer(stores, tmp_path, monkeypatch):
    """A batched step whose capture runs out of VRAM runs layer by layer (the same logits) and no other step does:
    whole steps stay on, and a one-token step over the same states still replays."""
    schedule = direct_schedule(tmp_path, backend="triton", batch_rows="device")
    want = _run(stores["nemotron_h"], schedule, False)[0]
    capture = WholeStep._capture

    def short(self, make, state, ids, past, rows=False):
        return whole_mod.OUT_OF_VRAM if rows else capture(self, make, state, ids, past, rows)
    monkeypatch.setattr(WholeStep, "_capture", short)
    with sluice.load(stores["nemotron_h"], device=DEVICE, schedule=schedule, static_kv=max(map(len, PROMPTS)) + STEPS + 8,
                     whole_step=True, vram_slots=10) as engine:
        if DEVICE == "cpu":
            engine.whole = WholeStep(engine.model, engine.coordinator, engine.rt, engine.routing, graphs=False)
        got = together(engine, PROMPTS)
        assert engine.whole.replays == 0 and engine.whole.off is None and engine.whole.rows_off is None
        seq = engine.new_sequence()
        engine.extend(seq, PROMPTS[0])
        for t in (3, 4, 5):
            engine.extend(seq, [t])
        assert engine.whole.replays == 2  # the first one-token step warms up, the next two replay
    assert all(torch.equal(g, w) for g, w in zip(got, want))
