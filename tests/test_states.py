"""Released sequences' states handed out again (pipeline/states.py): a sequence on a released, reset cache, or on one
filled in place from a snapshot, steps bit for bit as on a new cache; and it is the same cache (its tensors at the same
addresses, which is what lets a captured whole step replay at once: tests/test_whole.py)."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.errors import SluiceError
from common import DEVICE, PROMPT

OTHER = [9, 4, 31, 2, 66, 15, 7]
# Mamba + attention; DeltaNet + attention; MLA; sliding-window attention and sinks; compressor buffers and entries
CASES = [("nemotron_h_latent", None), ("nemotron_h_latent", 64), ("qwen3_next", None), ("deepseek_v3", 64),
         ("gpt_oss", None), ("deepseek_v4", None)]


def _run(engine, seq, prompt, steps: int = 4) -> torch.Tensor:
    logits = [engine.extend(seq, prompt)[-1]]
    for _ in range(steps):
        logits.append(engine.extend(seq, [int(logits[-1].argmax())])[-1])
    return torch.stack(logits).cpu()


@pytest.mark.parametrize("variant, static_kv", CASES)
def test_a_released_state_serves_the_next_sequence_exactly(variant, static_kv, stores):
    with sluice.load(stores[variant], device=DEVICE, static_kv=static_kv) as engine:
        fresh = engine.new_sequence()
        want = _run(engine, fresh, OTHER)
        snap = engine.snapshot(fresh)
        cont = _run(engine, fresh, [11, 3])
        used = engine.new_sequence()
        _run(engine, used, PROMPT)
        cache = used.cache
        engine.release(used)
        again = engine.new_sequence()
        assert again.cache is cache, "a released cache is handed out again"
        assert torch.equal(_run(engine, again, OTHER), want)
        engine.release(again)
        restored = engine.restore(snap)
        assert restored.cache is cache, "a snapshot is restored into a released cache"
        assert torch.equal(_run(engine, restored, [11, 3]), cont)


def test_without_the_reset_the_next_sequence_differs(stores, monkeypatch):
    """The check above must fail where a released cache keeps its old state (no reset)."""
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, static_kv=64) as engine:
        want = _run(engine, engine.new_sequence(), OTHER)
        used = engine.new_sequence()
        _run(engine, used, PROMPT)
        monkeypatch.setattr(type(used.cache), "reset", lambda self: None)
        engine.release(used)
        assert not torch.equal(_run(engine, engine.new_sequence(), OTHER), want)


def test_a_released_sequence_takes_no_step_and_a_broken_one_is_dropped(stores):
    with sluice.load(stores["nemotron_h"], device=DEVICE) as engine:
        seq = engine.new_sequence()
        engine.extend(seq, PROMPT)
        engine.release(seq)
        with pytest.raises(SluiceError, match="released"):
            engine.extend(seq, [3])
        broken = engine.new_sequence()
        broken.broken = True
        cache = broken.cache
        engine.release(broken)
        assert engine.new_sequence().cache is not cache, "a broken sequence's state is not handed out again"


def test_generate_hands_its_state_to_the_next_request(stores):
    with sluice.load(stores["nemotron_h"], device=DEVICE) as engine:
        first = engine.generate(PROMPT, 4)
        assert len(engine.states._spare) == 1
        assert engine.generate(PROMPT, 4) == first


def test_a_grown_state_is_not_kept(stores, monkeypatch):
    """A sequence whose static cache grew past its first slots gives its state up, not to the pool."""
    from sluice.models import static_cache

    monkeypatch.setattr(static_cache, "FIRST_SLOTS", 16)
    with sluice.load(stores["nemotron_h"], device=DEVICE, static_kv=64) as engine:
        short, long = engine.new_sequence(), engine.new_sequence()
        engine.extend(short, PROMPT)
        engine.extend(long, PROMPT + OTHER)  # 19 tokens: 32 slots
        assert not static_cache.grown(short.cache) and static_cache.grown(long.cache)
        cache = short.cache
        engine.release(long)
        engine.release(short)
        assert engine.states._spare == [cache]


def test_a_one_token_prompt_on_a_released_state_runs_as_a_prompt(stores, tmp_path):
    """A sequence whose first step is one token, on a state handed out again, runs that step as a prompt, not as the
    replay captured for the later steps: the fresh state's logits bit for bit."""
    from sluice.pipeline.whole import WholeStep
    from test_direct import direct_schedule

    schedule = direct_schedule(tmp_path, backend="triton")
    with sluice.load(stores["nemotron_h"], device=DEVICE, schedule=schedule, static_kv=32, whole_step=True) as engine:
        if DEVICE == "cpu":
            engine.whole = WholeStep(engine.model, engine.coordinator, engine.rt, engine.routing, graphs=False)
        want = _run(engine, engine.new_sequence(), [7])
        used = engine.new_sequence()
        _run(engine, used, [7])
        engine.release(used)
        replays = engine.whole.replays
        assert torch.equal(_run(engine, engine.new_sequence(), [7]), want)
        assert engine.whole.replays - replays == 4, "its four one-token steps after the first replay"
