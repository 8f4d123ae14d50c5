"""The engine worker's shared steps (api/worker.py): decode tokens first, then prompt chunks, within a token budget."""

from __future__ import annotations

import threading

import sluice
from common import DEVICE

PROMPTS = [list(range(3, 23)), [9, 4, 33, 71, 2], list(range(40, 49)), list(range(60, 90))]


def serve(engine, max_batch: int, step_tokens: int | None = None, tokens: int = 6):
    """Every prompt submitted at once to a fresh worker: each one's greedy tokens, and each shared step's pieces'
    lengths (in the order the step took them)."""
    from sluice.api.metrics import Metrics
    from sluice.api.snapshots import SnapshotStore
    from sluice.api.worker import EngineWorker, Job
    from sluice.pipeline.sampling import Sampler

    steps, real = [], engine.extend_many
    engine.extend_many = lambda seqs, pieces, *a, **k: (steps.append([len(p) for p in pieces]), real(seqs, pieces, *a, **k))[1]
    worker = EngineWorker(engine, SnapshotStore(0), Metrics(), prefill_chunk=8, max_batch=max_batch, step_tokens=step_tokens)
    out, done = [[] for _ in PROMPTS], threading.Semaphore(0)

    def emit(i):
        return lambda ev: out[i].append(ev[1]) if ev[0] == "token" else done.release() if ev[0] in ("done", "error") else None

    for i, p in enumerate(PROMPTS):  # all waiting before the worker's first turn
        worker.submit(Job(p, tokens, Sampler(), frozenset(), emit(i)))
    try:
        worker.start()
        for _ in PROMPTS:
            assert done.acquire(timeout=120)
    finally:
        worker.stop()
        del engine.extend_many
    return out, steps


def test_shared_steps_pack_decodes_then_prompt_chunks_into_the_budget(stores):
    """With --max-batch 4 and a budget of 12 rows, prompts arriving together prefill in shared steps (several prompts'
    chunks in one step, cut to what the budget leaves), decode tokens join them first; no step exceeds the budget or
    the batch; each request's tokens are those it gets one step at a time."""
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        alone, solo_steps = serve(engine, max_batch=1)
        shared, steps = serve(engine, max_batch=4, step_tokens=12)
    assert solo_steps == [] and shared == alone
    assert steps and all(sum(s) <= 12 and len(s) <= 4 for s in steps)
    assert any(sum(n > 1 for n in s) >= 2 for s in steps)  # two prompts' chunks in one step
    assert any(n < 8 for s in steps for n in s if n > 1)  # a chunk cut to the budget's rest (or a prompt's tail)
    assert any(1 in s and max(s) > 1 for s in steps)  # decode tokens beside a prompt chunk
    assert sum(len(s) for s in steps) > len(steps)  # steps were shared


def test_bench_load_reports_each_setting(stores, tmp_path, capsys):
    import json

    from sluice.cli import main

    out = tmp_path / "load.json"
    assert main(["bench", "load", "--model", str(stores["nemotron_h_latent"]), "--device", DEVICE, "--clients", "1,3",
                 "--max-batch", "1,4", "--decode-tokens", "3", "--prompt-length", "6", "--warm-tokens", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(row["clients"], row["max_batch"]) for row in r["rows"]] == [(1, 1), (3, 1), (1, 4), (3, 4)]
    assert all(row["aggregate_tok_s"] > 0 and 0 < row["ttft_median_s"] <= row["ttft_max_s"] for row in r["rows"])
    assert "routing: natural" in capsys.readouterr().out
    assert main(["bench", "load", "--model", str(stores["nemotron_h_latent"]), "--device", DEVICE, "--clients", "0,x"]) != 0
    assert "--clients '0,x': comma-separated counts >= 1" in capsys.readouterr().err
    try:
        assert main(["bench", "load", "--model", str(stores["nemotron_h_latent"]), "--warm-tokens", "1"]) != 0
    except SystemExit as e:  # argparse's exit on a bad value
        assert e.code != 0
    assert "--warm-tokens" in capsys.readouterr().err


def test_the_worker_trims_only_when_no_request_waits(stores, monkeypatch):
    """Going idle, the worker gives freed memory back (api/memory.py `trim`), but not while requests wait in its inbox:
    requests that arrive together get their first step without that pause first (it trimmed first before)."""
    from sluice.api import worker as W

    log = []
    monkeypatch.setattr(W, "trim", lambda: log.append("trim"))
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        real = engine.extend
        monkeypatch.setattr(engine, "extend", lambda *a, **k: (log.append("step"), real(*a, **k))[1])
        serve(engine, max_batch=1, tokens=2)
    assert log[0] == "step" and log.count("step") > len(PROMPTS)
