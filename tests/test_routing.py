"""Routing under control (`--routing`): settings, their tables' statistics, and the engine routing by them."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.errors import ConfigError, SluiceError
from sluice.storage import routing as R
from sluice.storage.simulate import guess_recall, simulate
from sluice.storage.trace import read_trace
from common import DEVICE, PROMPT


@pytest.mark.parametrize("text, culprit", [
    ("bogus", "unknown kind 'bogus'"), ("skewed:reuse=2", "reuse must be in"), ("uniform:foo=1", "'foo=1'"),
    ("skewed:popularity=x", "popularity must be a number"), ("trace", "trace:FILE"), ("natural:recall=1", "no options"),
])
def test_bad_settings_name_the_culprit(text, culprit):
    with pytest.raises(ConfigError, match=culprit):
        R.parse_routing(text)


def test_settings_print_as_they_parse():
    for text in ("natural", "uniform:recall=0.7", "skewed:popularity=1.5,reuse=0.1,recall=0.65", "trace:a.jsonl,recall=0.7"):
        assert str(R.parse_routing(text)) == text
    assert str(R.parse_routing("skewed")) == "skewed:calibrated,recall=0.7"


def _recall(ids, guesses) -> float:
    return float((guesses.unsqueeze(-1) == ids.unsqueeze(-2)).any(-1).float().mean())


def test_uniform_tables():
    L, E, K = 6, 64, 6
    ids, guesses = R.routing_tables(R.parse_routing("uniform:recall=0.6"), L, E, K, positions=2000)
    assert ids.shape == guesses.shape == (2000, L, K)
    for t in (ids, guesses):  # K distinct experts per token and layer
        assert (t.long().sort(-1).values.diff(dim=-1) > 0).all() and int(t.min()) >= 0 and int(t.max()) < E
    assert abs(_recall(ids.long(), guesses.long()) - 0.6) < 0.02
    assert abs(R.repeat_share(ids.long()) - K / E) < 0.02  # consecutive tokens share what chance gives
    counts = torch.bincount(ids.long().flatten(), minlength=E).float()
    assert counts.std() / counts.mean() < 0.1  # every expert about as popular


def test_skewed_is_calibrated_to_real_models():
    """Calibrated at a Nemotron-3-Nano-like shape (128 experts, top-6): an LRU cache of 24% of the blocks hits 81-84%
    (the offline simulator's global LRU over every layer agrees), repeat stays near 40% (as low as the target hit rate
    allows with a static popularity) and guesses are right at the set recall."""
    L, E, K = 8, 128, 6
    setting = R.for_shape(R.parse_routing("skewed"), E, K)
    assert setting.popularity is not None and setting.reuse is not None
    ids, guesses = R.routing_tables(setting, L, E, K, positions=1200)
    ids = ids.long()
    assert 0.80 <= R.lru_hit_rate(ids, int(0.24 * E)) <= 0.85
    sim = simulate(R.table_trace(ids, None, list(range(L)), E), ram_blocks=int(0.24 * L * E), prefetch=False)
    assert 0.78 <= sim.hit_rate <= 0.86
    assert 0.35 <= R.repeat_share(ids) <= 0.5
    assert abs(_recall(ids, guesses.long()) - 0.7) < 0.02
    # where a lower static popularity lets reuse carry the repeat (512 experts, top-10, the reference system's shape)
    s, p = R.calibrate(512, 10)
    assert p > 0 and abs(R.repeat_share(R._skewed(600, 2, 512, 10, s, p, torch.Generator().manual_seed(1))) - 0.4) < 0.05


def _tokens_and_trace(store, tmp_path, schedule: str, routing: str, tag: str):
    path = tmp_path / f"{tag}.jsonl"
    record = None if schedule == "direct" else str(path)  # direct (hold: true) keeps ids on the device: records none
    with sluice.load(store, device=DEVICE, schedule=schedule, routing=routing, record_routing=record) as engine:
        out = engine.generate(PROMPT, 8)
        control = engine.routing
        ids = control.ids.transpose(0, 1).cpu() if control is not None else None  # [N, L, K]
    return out, (read_trace(path) if record else None), ids


def test_every_schedule_routes_by_the_table(stores, tmp_path):
    """The same tokens on every schedule under a drawn routing, and the recorded ids are the table's rows."""
    store = stores["nemotron_h"]
    natural, *_ = _tokens_and_trace(store, tmp_path, "overlap", "natural", "nat")
    runs = {s: _tokens_and_trace(store, tmp_path, s, "uniform", s) for s in ("overlap", "serial", "direct", "direct-stream")}
    tokens = {s: r[0] for s, r in runs.items()}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens
    assert tokens["overlap"] != natural  # the draw decides: a check that would pass with the model's own routing fails
    trace, table = runs["overlap"][1], runs["overlap"][2]
    assert trace.header["routing"] == "uniform:recall=0.7"
    order = {layer: i for i, layer in enumerate(trace.header["moe_layers"])}
    position = {}
    for r in trace.records:
        at = position.setdefault(r.step, sum(x.tokens for x in trace.records if x.step < r.step and x.layer == r.layer))
        K = len(r.ids) // r.tokens
        rows = table[at : at + r.tokens, order[r.layer]].reshape(-1).tolist()
        assert list(r.ids) == rows and K == table.shape[2]


def test_guesses_follow_the_recall(stores, tmp_path):
    _, trace, _ = _tokens_and_trace(stores["qwen3_moe"], tmp_path, "overlap", "uniform:recall=0.5", "q")
    near, _ = guess_recall(trace)
    assert near is not None and 0.2 <= near <= 0.8  # 8 decode steps of a few layers: the set 0.5, loosely


def test_a_recorded_routing_replays(stores, tmp_path):
    """trace:FILE replays the recorded ids token by token: a run under it records the same ids again."""
    store = stores["nemotron_h"]
    _, first, _ = _tokens_and_trace(store, tmp_path, "overlap", "skewed:popularity=1,reuse=0.2", "first")
    _, again, _ = _tokens_and_trace(store, tmp_path, "overlap", f"trace:{tmp_path / 'first.jsonl'}", "again")
    assert [r.ids for r in again.records] == [r.ids for r in first.records]


def test_a_trace_of_another_shape_is_refused(stores, tmp_path):
    import json

    _tokens_and_trace(stores["nemotron_h"], tmp_path, "overlap", "natural", "n")
    lines = (tmp_path / "n.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    (tmp_path / "other.jsonl").write_text("\n".join([json.dumps(dict(head, num_experts=head["num_experts"] + 1))] + lines[1:]))
    with pytest.raises(SluiceError, match="trace routes top-"):
        sluice.load(stores["nemotron_h"], device=DEVICE, routing=f"trace:{tmp_path / 'other.jsonl'}")


def test_the_cursor_wraps_at_the_tables_end():
    """A one-token read is the table's row at the cursor, a prompt's rows run on across the table's end, and the
    cursor stays within the table (a one-token read is one gather at it)."""
    from types import SimpleNamespace

    from sluice.pipeline.routing import RoutingControl

    blocks = [SimpleNamespace(layer=l, num_experts=16, top_k=2) for l in (1, 3)]
    control = RoutingControl(R.parse_routing("uniform"), blocks, torch.device("cpu"))
    table, n = control.ids, control.positions  # [L, N, K]
    control.advance(n - 2)
    assert torch.equal(control._read(table, 1, 1), table[1, n - 2 : n - 1])
    assert torch.equal(control._read(table, 0, 4), table[0, [n - 2, n - 1, 0, 1]])
    control.advance(5)
    assert int(control.cursor) == 3 and torch.equal(control._read(table, 1, 1), table[1, 3:4])
