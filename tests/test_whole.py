"""A one-token step replayed whole as one graph (pipeline/whole.py) against the same step run layer by layer: the same
logits bit for bit at every decode step, on the fast schedule's variants. On a CPU the whole step's body runs eagerly
(what a capture would take in: the position read from a device tensor, masks made from the static cache, the MoE
layers' composed steps with the token's host work before them and their tallies after); SLUICE_TEST_DEVICE=cuda
captures and replays it."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.pipeline.whole import WholeStep
from common import DEVICE, PROMPT, greedy_logits
from test_direct import direct_schedule

STEPS = 8


def _open(store, schedule, whole: bool, **settings):
    engine = sluice.load(store, device=DEVICE, schedule=schedule, static_kv=len(PROMPT) + STEPS + 4, whole_step=whole,
                         **settings)
    if whole and DEVICE == "cpu":  # no graphs on a CPU: the body itself, eagerly, at every step
        engine.whole = WholeStep(engine.model, engine.coordinator, engine.rt, engine.routing, graphs=False)
    return engine


SETTINGS = {  # the fast schedule's variants: VRAM tier and staging ahead; shared expert after the routed ones; routing drawn
    "tier-staged": dict(backend="triton", refresh=2, token_ahead=2),
    "shared-late": dict(backend="triton", shared="late", refresh=3),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_whole_step_gives_the_layer_by_layer_logits(setting, stores, tmp_path, monkeypatch):
    """Greedy decode's logits at every step equal bit for bit with the step replayed whole and run layer by layer; the
    replays happened (the first one-token step at each attention window runs layer by layer: windows of 16 and 32
    slots here), and the tier counted the same blocks."""
    from sluice.models import static_cache

    monkeypatch.setattr(static_cache, "MIN_WINDOW", 16)
    schedule = direct_schedule(tmp_path, **SETTINGS[setting])
    got = {}
    for whole in (False, True):
        with _open(stores["nemotron_h_latent"], schedule, whole, vram_slots=12) as engine:
            got[whole] = greedy_logits(engine, PROMPT, STEPS)
            blocks = dict(engine.rt.stats.blocks)
            if whole:
                assert engine.whole.replays == STEPS - 3, "every one-token step but the first at each window replays"
                assert engine.whole.captures == (2 if DEVICE != "cpu" else 0)
            got[whole, "blocks"] = blocks
    assert torch.equal(got[True], got[False]), f"{setting}: whole-step logits differ by {(got[True] - got[False]).abs().max()}"
    assert got[True, "blocks"] == got[False, "blocks"], "the replays' tallies are the layer-by-layer steps'"


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_whole_step_of_a_decoder_model(variant, stores, tmp_path):
    """A decoder model's one-token step whole (checked on an H100 with SLUICE_TEST_DEVICE=cuda, so these replay whole by
    default there: `whole_checked`, and the others of their kind do not): its attention over the static cache at the position read from the device, rotary tables made from it, each MoE layer's
    composed step on the MoE input the layer module gives; the layer-by-layer logits bit for bit."""
    schedule = direct_schedule(tmp_path, backend="triton", refresh=2)
    got = []
    for whole in (False, True):
        with _open(stores[variant], schedule, whole, vram_slots=8) as engine:
            got.append(greedy_logits(engine, PROMPT, STEPS))
            assert not whole or engine.whole.replays == STEPS - 2
    assert torch.equal(got[0], got[1]), f"{variant}: whole-step logits differ by {(got[0] - got[1]).abs().max()}"
    assert engine.model.whole_checked


def test_only_checked_decoder_models_replay_whole_by_default(stores):
    with sluice.load(stores["qwen3_next"], device=DEVICE) as engine:
        assert not engine.model.whole_checked  # DeltaNet layers: not checked on a GPU


def test_whole_step_under_controlled_routing(stores, tmp_path):
    """Routing drawn from tables (`--routing uniform`): the cursor moves inside the whole step, so each replay routes
    the next position's ids, as layer by layer."""
    schedule = direct_schedule(tmp_path, backend="triton")
    got = []
    for whole in (False, True):
        with _open(stores["nemotron_h"], schedule, whole, routing="uniform") as engine:
            got.append(greedy_logits(engine, PROMPT, STEPS))
    assert torch.equal(got[0], got[1])


def test_a_cursor_left_behind_is_caught(stores, tmp_path):
    """The check must fail: a whole step that does not move the routing cursor inside itself routes every replay to
    the ids of the position it was captured at, and gives other logits."""
    schedule = direct_schedule(tmp_path, backend="triton")
    with _open(stores["nemotron_h"], schedule, False, routing="uniform") as engine:
        want = greedy_logits(engine, PROMPT, STEPS)
    with _open(stores["nemotron_h"], schedule, True, routing="uniform") as engine:
        engine.whole.routing = None  # the body's advance left out
        got = greedy_logits(engine, PROMPT, STEPS)
    assert torch.equal(got[:2], want[:2]) and not torch.equal(got, want)


def test_refusals_name_the_reason(stores, tmp_path):
    """Whole steps where nothing in a one-token step needs the host; otherwise the reason, and steps layer by layer."""
    fast = direct_schedule(tmp_path, backend="triton")
    cases = [("nemotron_h", fast, None, None, "--static-kv"), ("nemotron_h", "overlap", 64, None, "not composed"),
             ("qwen3_next", fast, 64, None, "not yet checked on a GPU"), ("qwen3_moe", fast, 64, None, None),
             ("gpt_oss", fast, 64, True, "sliding-window attention"), ("nemotron_h", "direct-stream", 64, None, "hold: false"),
             ("nemotron_h", fast, 64, None, None)]
    for variant, schedule, static_kv, asked, why in cases:
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule, static_kv=static_kv) as engine:
            refusal = WholeStep.refusal(engine.model, engine.coordinator, engine.rt, static_kv, asked)
            assert refusal is None if why is None else why in refusal, (variant, schedule, refusal)


def test_a_whole_step_keeps_each_stages_span(stores, tmp_path):
    """With a trace, each MoE layer of every one-token step keeps a span per stage it is composed of (route, fetch,
    compute, combine), replayed whole or not: on a GPU from the events the whole graph records on each replay."""
    import json

    schedule = direct_schedule(tmp_path, backend="triton", vram=False)
    trace = tmp_path / "whole.json"
    with _open(stores["nemotron_h"], schedule, True, trace=str(trace)) as engine:
        greedy_logits(engine, PROMPT, STEPS)
        layers = len(engine.store.moe_layers)
        assert engine.whole.replays == STEPS - 2
    seen: dict[str, set] = {}
    for line in (tmp_path / "whole.json.jsonl").read_text().splitlines():
        line = json.loads(line)
        if line.get("event") in ("stage", "gpu") and line["step"] > 0:
            seen.setdefault(line["stage"], set()).add((line["step"], line["layer"]))
    for stage in ("route", "fetch", "compute", "combine"):
        assert len(seen.get(stage, ())) == (STEPS - 1) * layers, (stage, sorted(seen.get(stage, ())))


def test_a_snapshot_of_a_windowed_cache_restores_exactly(stores, tmp_path, monkeypatch):
    """A sequence over a static cache read through windows, snapshotted and restored, continues bit for bit as the
    original (its windows come along), across the window's growth, its steps replayed whole on a GPU."""
    from sluice.models import static_cache

    monkeypatch.setattr(static_cache, "MIN_WINDOW", 16)
    schedule = direct_schedule(tmp_path, backend="triton")
    with _open(stores["nemotron_h"], schedule, True) as engine:
        seq = engine.new_sequence()
        engine.extend(seq, PROMPT)
        snap = engine.snapshot(seq)
        live = [engine.extend(seq, [t])[-1].cpu() for t in range(3, 12)]  # 13 .. 21 tokens: windows of 16, then 32
        again = engine.restore(snap)
        assert {layer.window for layer in again.cache.layers if hasattr(layer, "window")} == {16}
        assert torch.equal(torch.stack([engine.extend(again, [t])[-1].cpu() for t in range(3, 12)]), torch.stack(live))


def test_a_released_state_replays_from_the_next_sequences_first_step(stores, tmp_path, monkeypatch):
    """A sequence on a released state (pipeline/states.py) replays its steps whole from its first one-token step, with
    no capture, the first sequence's logits bit for bit."""
    from sluice.models import static_cache

    monkeypatch.setattr(static_cache, "MIN_WINDOW", 16)
    with _open(stores["nemotron_h"], direct_schedule(tmp_path, backend="triton"), True) as engine:
        first = greedy_logits(engine, PROMPT, STEPS, release=True)
        replays, captures = engine.whole.replays, engine.whole.captures
        assert replays == STEPS - 3
        assert torch.equal(greedy_logits(engine, PROMPT, STEPS), first)
        assert (engine.whole.replays - replays, engine.whole.captures) == (STEPS - 1, captures)


def test_asked_for_but_refused_says_why(stores, capsys):
    """`whole_step=True` where a step cannot replay whole: a warning naming why, and steps layer by layer."""
    with sluice.load(stores["nemotron_h"], device=DEVICE, schedule="overlap", whole_step=True) as engine:
        assert engine.whole is None
    err = capsys.readouterr().err
    assert "one-token steps run layer by layer, not whole" in err
    assert ("CUDA graphs are off" if DEVICE == "cpu" else "not composed") in err


def test_a_checked_model_gets_a_static_cache_by_default_on_cuda():
    """Unset, static_kv is the model's context on CUDA for a model whose whole step is checked (slots allocated as
    used), so its steps replay whole without a flag; 0 or --no-whole-step keep the growing cache, a CPU too; a count
    given is kept."""
    from types import SimpleNamespace

    from sluice.pipeline.config import EngineConfig
    from sluice.pipeline.whole import default_static_kv

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    checked = SimpleNamespace(whole_checked=True, config=SimpleNamespace(max_position_embeddings=4096))
    other = SimpleNamespace(whole_checked=False, config=checked.config)
    assert default_static_kv(EngineConfig(), checked, cuda) == 4096
    assert default_static_kv(EngineConfig(), checked, cpu) is None
    assert default_static_kv(EngineConfig(), other, cuda) is None
    assert default_static_kv(EngineConfig(whole_step=False), checked, cuda) is None
    assert default_static_kv(EngineConfig(static_kv=0), checked, cuda) is None
    assert default_static_kv(EngineConfig(static_kv=640), other, cuda) == 640
