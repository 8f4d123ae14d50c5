"""Several sequences decoding in one step (Engine.extend_many, pipeline/batch.py): each sequence's logits and greedy
tokens equal its one-at-a-time decode's, on every family and on the streaming and direct schedules; the union of
their experts is read once per layer, grouped on the host or on the device; rows that trade places are caught."""

from __future__ import annotations

import pytest
import torch

import sluice
from common import DEVICE, PROMPT, VARIANTS, assert_logits_close

PROMPTS = [PROMPT, PROMPT[3:] + [7, 7], [9, 4, 33, 71, 2]]
STEPS = 6


def alone(engine, prompt: list[int]) -> torch.Tensor:
    """Greedy decode of one sequence: the last position's logits of the prompt and of STEPS - 1 steps [STEPS, V]."""
    seq = engine.new_sequence()
    out = [engine.extend(seq, prompt)[-1]]
    for _ in range(STEPS - 1):
        out.append(engine.extend(seq, [int(out[-1].argmax())])[-1])
    return torch.stack(out).cpu()


def together(engine, prompts: list[list[int]], swap: bool = False) -> list[torch.Tensor]:
    """The same, every sequence's decode steps in one batched step each (`swap`: two rows' logits exchanged, a fault)."""
    seqs = [engine.new_sequence() for _ in prompts]
    out = [[engine.extend(s, p)[-1]] for s, p in zip(seqs, prompts)]
    for _ in range(STEPS - 1):
        logits = engine.extend_many(seqs, [int(o[-1].argmax()) for o in out])
        if swap:
            logits[0], logits[1] = logits[1], logits[0]
        for o, l in zip(out, logits):
            o.append(l[-1])
    return [torch.stack(o).cpu() for o in out]


BATCHABLE = [v for v in VARIANTS if not v.startswith("deepseek_v4")]  # keeps one step's state between a layer's parts


@pytest.mark.parametrize("variant", BATCHABLE)
@pytest.mark.parametrize("schedule", ["overlap", "direct"])
def test_batched_decode_equals_one_at_a_time(variant, schedule, stores):
    with sluice.load(stores[variant], device=DEVICE, schedule=schedule) as engine:
        want = [alone(engine, p) for p in PROMPTS]
        got = together(engine, PROMPTS)
    for b, (g, w) in enumerate(zip(got, want)):
        assert_logits_close(variant, g, w, f"{variant} {schedule} sequence {b}")
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()


@pytest.mark.parametrize("variant", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_fused_attention_takes_the_packed_rows(variant, stores, monkeypatch):
    """With fused ops, the attentions' norms and rotation (models/norm_rope.py) take several sequences' rows packed into
    one call: each sequence's logits are its own alone with the same ops."""
    from sluice.models import norm_rope

    rows, rotate, batched = [], norm_rope.norm_rope, []
    monkeypatch.setattr(norm_rope, "norm_rope", lambda q, *a: rows.append((bool(batched), q.shape[1])) or rotate(q, *a))
    prompts = [PROMPTS[2], PROMPTS[2][1:4]]  # short ones: the kernels run interpreted
    with sluice.load(stores[variant], device=DEVICE, schedule="direct", fused_ops=True) as engine:
        want = [alone(engine, p) for p in prompts]
        many = engine.extend_many
        monkeypatch.setattr(engine, "extend_many", lambda *a, **k: batched.append(1) or many(*a, **k))
        got = together(engine, prompts)
    for b, (g, w) in enumerate(zip(got, want)):
        assert_logits_close(variant, g, w, f"{variant} fused sequence {b}")
    assert (True, len(prompts)) in rows  # a batched step's rows in one call


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe", "qwen3_next", "gpt_oss"])
def test_prompt_pieces_beside_decode_tokens(variant, stores):
    """A prompt prefilled in pieces that share steps with two other sequences' decode tokens (and with each other)
    ends in the same logits as its prompt run alone; the decoding sequences' logits are theirs alone too."""
    with sluice.load(stores[variant], device=DEVICE) as engine:
        want_prompt = alone(engine, PROMPTS[0])[0]
        want_others = [alone(engine, p) for p in PROMPTS[1:]]
        new, others = engine.new_sequence(), [engine.new_sequence() for _ in PROMPTS[1:]]
        got_others = [[engine.extend(o, p)[-1]] for o, p in zip(others, PROMPTS[1:])]
        pieces = [PROMPTS[0][:5], PROMPTS[0][5:9], PROMPTS[0][9:]]
        for piece in pieces:  # the new prompt's pieces beside the others' decode steps
            logits = engine.extend_many([new, *others], [piece, *(int(g[-1].argmax()) for g in got_others)])
            for g, l in zip(got_others, logits[1:]):
                g.append(l[-1])
    assert_logits_close(variant, logits[0][-1:].cpu(), want_prompt[None], f"{variant} prompt in pieces")
    for b, (g, w) in enumerate(zip(got_others, want_others)):
        assert_logits_close(variant, torch.stack(g).cpu(), w[: len(g)], f"{variant} decode {b} beside a prompt")


def test_mamba_blocks_take_every_sequences_row_at_once(stores, monkeypatch):
    """A Mamba-2 block's decode rows of several sequences go through its projections together (`forward_rows`),
    each sequence's state updated on its own: the logits are still each one's alone; with the states handed to the
    wrong sequences (a fault) they are not."""
    from sluice.models.nemotron_h import _MixerLayer

    variant, taken, real = "nemotron_h_latent", [], _MixerLayer.forward_rows

    def spy(self, hs, ctxs):
        out = real(self, hs, ctxs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_MixerLayer, "forward_rows", spy)
    with sluice.load(stores[variant], device=DEVICE) as engine:
        want = [alone(engine, p) for p in PROMPTS]
        got = together(engine, PROMPTS)
        for b, (g, w) in enumerate(zip(got, want)):
            assert_logits_close(variant, g, w, f"{variant} sequence {b}")
        assert any(taken)

        def swapped(self, hs, ctxs):
            return real(self, hs, ctxs[1:] + ctxs[:1])  # each row stepped on another sequence's state

        monkeypatch.setattr(_MixerLayer, "forward_rows", swapped)
        bad = together(engine, PROMPTS)
    assert any((b - w).abs().max() > 1e-3 for b, w in zip(bad, want))


def shared_and_faulted(variant, stores, monkeypatch, cls, name: str, width, fault) -> None:
    """Batched decode through `cls.name` (a part of models/rows.py, counted: `width(self)` sequences a call) gives each
    sequence's logits alone; with `fault(self)` applied before each call, the same check fails."""
    calls, real = [], getattr(cls, name)

    def spy(self, *args, **kwargs):
        calls.append(width(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, spy)
    with sluice.load(stores[variant], device=DEVICE) as engine:
        want = [alone(engine, p) for p in PROMPTS]
        got = together(engine, PROMPTS)
        for b, (g, w) in enumerate(zip(got, want)):
            assert_logits_close(variant, g, w, f"{variant} sequence {b}")
        assert calls and set(calls) == {len(PROMPTS)}

        def faulted(self, *args, **kwargs):
            fault(self)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, faulted)
        bad = together(engine, PROMPTS)
    with pytest.raises(AssertionError, match="max \\|dlogit\\|"):  # the check that passed above
        for b, w in zip(bad, want):
            assert_logits_close(variant, b, w, f"{variant} {name} faulted")


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5_moe"])
def test_attention_layers_take_every_sequences_rows_at_once(variant, stores, monkeypatch):
    """An attention layer runs once over every sequence's rows, each sequence's attention over its own cache
    (models/rows.py): the logits are still each one's alone; with each sequence's keys, queries and mask sent to
    another's cache (a fault) they are not."""
    from dataclasses import replace

    from sluice.models.rows import RowsCache

    def rotate(self):
        rows = self.rows
        self.rows = replace(rows, caches=rows.caches[1:] + rows.caches[:1], masks=rows.masks[1:] + rows.masks[:1])

    shared_and_faulted(variant, stores, monkeypatch, RowsCache, "update", lambda c: len(c.rows.lengths), rotate)


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5_moe"])
def test_deltanet_layers_take_every_sequences_decode_row_at_once(variant, stores, monkeypatch):
    """A DeltaNet layer's decode rows of several sequences run in one call over their gathered states, which go back to
    each sequence's cache (models/rows.py `RowsStates`): the logits are still each one's alone; with the states put
    back into the wrong sequences' caches (a fault) they are not."""
    from transformers import DynamicCache

    from sluice.models.rows import RowsStates

    if not hasattr(DynamicCache, "get_recurrent_state"):  # RowsStates.takes: then one sequence at a time, as alone
        pytest.skip("this transformers' cache has no per-layer state calls (before 5.2x)")

    def rotate(self):
        self.caches = self.caches[1:] + self.caches[:1]

    shared_and_faulted(variant, stores, monkeypatch, RowsStates, "put_back", lambda s: len(s.caches), rotate)


@pytest.mark.parametrize("variant,routing", [("nemotron_h", None), ("nemotron_h", "skewed"),  # CI: ReLU^2; SwiGLU in test-all
                                             pytest.param("gpt_oss", None, marks=pytest.mark.slow)])
def test_batch_rows_grouped_on_the_device_equal_the_host_routed_rows(variant, routing, stores, tmp_path, monkeypatch):
    """compute's `batch_rows: device` (one pass a layer over the union of the rows' experts, grouped on the device: no
    host wait) gives the host-routed batched step's logits bit for bit (each row's tiles are the same) and reads as
    many blocks, over a VRAM tier that its refreshes fill; the rows' weights handed to other rows inside the pass show
    (the must-fail side)."""
    from sluice.kernels.experts import TritonExperts
    from test_direct import direct_schedule

    def run(mode):
        schedule = direct_schedule(tmp_path, f"rows-{mode}", backend="triton", batch_rows=mode, refresh=2)
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule, routing=routing, vram_slots=8) as engine:
            before = engine.rt.stats.snapshot()
            logits = together(engine, PROMPTS)
            return logits, engine.rt.stats.since(before)["blocks"]

    (device, read), (host, host_read) = run("device"), run("host")
    assert all(torch.equal(a, b) for a, b in zip(device, host))
    assert sum(read.values()) == sum(host_read.values()) and read["vram"] > 0
    rows = TritonExperts.run_rows
    monkeypatch.setattr(TritonExperts, "run_rows",
                        lambda self, bank, offs, ids, counts, xe, w, y, tile: rows(self, bank, offs, ids, counts, xe, w.flip(0), y, tile))
    assert not all(torch.equal(a, b) for a, b in zip(run("device")[0], host))


def test_rows_tile_changes_only_the_order_of_sums(stores, tmp_path):
    """compute's `rows_tile` (the grouped GEMMs' tiles over a batched step's decode rows) gives the same logits within
    the golden tolerance (its K tiles add in another order); a malformed one is named."""
    from sluice.errors import ScheduleError
    from test_direct import direct_schedule

    def run(tile):
        schedule = direct_schedule(tmp_path, f"tile-{tile}", backend="triton", rows_tile=tile)
        with sluice.load(stores["nemotron_h"], device=DEVICE, schedule=schedule, vram_slots=8) as engine:
            return together(engine, PROMPTS)

    for a, b in zip(run("auto"), run("32x64x4")):
        assert_logits_close("nemotron_h", a, b, "rows_tile 32x64x4")
    for bad in ("64x128", "48x128x4", "64x16x4", "64x128x3"):  # a part missing, not a power of two, too small a K tile
        with pytest.raises(ScheduleError, match="'rows_tile' must be auto or BNxBKxWARPS"):
            sluice.load(stores["nemotron_h"], device=DEVICE, schedule=direct_schedule(tmp_path, "bad", rows_tile=bad))


def test_rows_that_trade_places_are_caught(stores):
    with sluice.load(stores["qwen3_moe"], device=DEVICE) as engine:
        want = [alone(engine, p) for p in PROMPTS]
        got = together(engine, PROMPTS, swap=True)
    with pytest.raises(AssertionError, match="max \\|dlogit\\|"):
        assert_logits_close("qwen3_moe", got[0], want[0], "swapped rows")


def test_a_batch_reads_each_routed_block_once(stores):
    """Three sequences in one step read the union of their experts: fewer block lookups than three steps alone."""
    with sluice.load(stores["qwen3_moe"], device=DEVICE, ram_cache="1GiB") as engine:
        seqs = [engine.new_sequence() for _ in PROMPTS]
        for s, p in zip(seqs, PROMPTS):
            engine.extend(s, p)
        before = sum(engine.rt.stats.snapshot()["blocks"].values())
        engine.extend_many(seqs, [1, 2, 3])
        batched = sum(engine.rt.stats.snapshot()["blocks"].values()) - before
        before = sum(engine.rt.stats.snapshot()["blocks"].values())
        for s, t in zip(seqs, [4, 5, 6]):
            engine.extend(s, [t])
        alone_blocks = sum(engine.rt.stats.snapshot()["blocks"].values()) - before
    layers, k = len(engine.store.moe_layers), engine.store.manifest.top_k
    assert alone_blocks == 3 * layers * k  # every routed (token, layer) block looked up
    assert batched < alone_blocks  # the union: experts two sequences share in a layer counted once


def test_batched_decode_steps_guess_the_next_layers(stores):
    """The predict stage guesses for a batch of decode tokens (their guesses' union) as for one; not for prompts."""
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, schedule="overlap") as engine:
        seqs = [engine.new_sequence() for _ in PROMPTS]
        for s, p in zip(seqs, PROMPTS):
            engine.extend(s, p)
        before = engine.rt.stats.snapshot()["predicted"]
        engine.extend_many(seqs, [1, 2, 3])
        assert engine.rt.stats.snapshot()["predicted"] > before


def test_bad_batches_are_refused(stores):
    from sluice.errors import SluiceError

    with sluice.load(stores["qwen3_moe"], device=DEVICE) as engine:
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.extend(a, PROMPT)
        with pytest.raises(SluiceError, match="one piece per sequence"):
            engine.extend_many([a], [1, 2])
        with pytest.raises(SluiceError, match="appears twice"):
            engine.extend_many([a, a], [1, 2])
        with pytest.raises(SluiceError, match="non-empty list of token ids"):
            engine.extend_many([a, b], [1, []])
    with sluice.load(stores["deepseek_v4"], device=DEVICE) as engine:
        a = engine.new_sequence()
        engine.extend(a, PROMPT)
        with pytest.raises(SluiceError, match="decode its sequences one at a time"):
            engine.extend_many([a], [1])


def test_bench_batch_reports_each_batch_size(stores, tmp_path, capsys):
    import json

    from sluice.cli import main

    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--model", str(stores["qwen3_moe"]), "--device", DEVICE, "--batches", "1,3",
                 "--decode-tokens", "2", "--prompt-length", "4", "--warm-tokens", "2", "--json", str(out), "--profile"]) == 0
    r = json.loads(out.read_text())
    assert r["routing"] == "natural" and [row["batch"] for row in r["rows"]] == [1, 3]
    assert all(row["aggregate_tok_s"] > 0 and row["expert_bytes_per_token"] > 0 and 0 <= row["vram_share"] <= 1 for row in r["rows"])
    printed = capsys.readouterr().out
    assert "routing: natural" in printed and "profile of 3 sequences a step" in printed and "step_many" in printed
