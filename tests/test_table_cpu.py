"""The fast path's hybrid miss path (compute's `cpu_share`, stages/table_cpu.py): of a one-token step's blocks outside
VRAM the CPU computes a share from their RAM slots while the GPU kernels read the rest; its rows join the GPU's in
combine's fixed-order sum."""
from __future__ import annotations

import json

import pytest
import torch

import sluice
from sluice.errors import ScheduleError
from common import DEVICE, PROMPT, assert_logits_close, greedy_logits
from test_direct import direct_schedule

STEPS = 6


@pytest.mark.parametrize("variant", ["nemotron_h_latent", pytest.param("gpt_oss", marks=pytest.mark.slow)])  # ~30 s: CI once
def test_cpu_share_gives_the_direct_logits(variant, stores, refs, tmp_path, monkeypatch):
    """With half the blocks outside VRAM on the CPU: the reference's greedy tokens, every decode step's logits those of
    direct without the share within the golden tolerance (the CPU's kernels round their own way), blocks from all three
    places (VRAM, the GPU over PCIe, the CPU); the CPU's rows weighted twice over (a fault) are caught."""
    from sluice.stages.table_cpu import CpuSteps

    plain = direct_schedule(tmp_path, "plain", backend="triton", refresh=2)
    hybrid = direct_schedule(tmp_path, "hybrid", backend="triton", refresh=2, cpu_share=0.5, cpu_compile=False)

    def run(schedule):
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule, vram_slots=4) as engine:
            logits = greedy_logits(engine, PROMPT, STEPS)
            return logits, engine.rt.stats.snapshot(), engine.whole

    want, _, _ = run(plain)
    got, io, whole = run(hybrid)
    assert [int(t) for t in got.argmax(-1)] == refs.greedy(variant, PROMPT, STEPS)
    assert_logits_close(variant, got, want, f"{variant} with the CPU's share")
    assert io["cpu_blocks"] > 0 and io["blocks"]["vram"] > 0 and io["blocks"]["ram"] > io["cpu_blocks"]
    assert whole is None or DEVICE != "cpu"  # no graphs on a CPU (on CUDA a static cache's step replays in segments)

    rows = CpuSteps._cpu_rows
    monkeypatch.setattr(CpuSteps, "_cpu_rows", lambda self, block, experts, xe, w, *a: rows(self, block, experts, xe, 2 * w, *a))
    wrong, _, _ = run(hybrid)
    with pytest.raises(AssertionError, match="max \\|dlogit\\|"):
        assert_logits_close(variant, wrong, want, "the CPU's rows weighted twice")


def test_cpu_share_needs_every_block_held(stores, tmp_path):
    schedule = direct_schedule(tmp_path, "stream-hybrid", base="direct-stream", cpu_share=0.5)
    with pytest.raises(ScheduleError, match="cpu_share.*hold: true"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=schedule)


@pytest.mark.parametrize("cpu_wait", ["host", "device"] if DEVICE.startswith("cuda") else ["host"])
def test_cpu_share_in_a_whole_step(cpu_wait, stores, refs, tmp_path, monkeypatch):
    """A whole step with the CPU's share (pipeline/whole.py): the split made on the device (the lowest-ranked blocks
    outside VRAM, up to each layer's count), the host's turns computing the CPU's rows, the GPU waiting for them inside
    one graph (cpu_wait: device) or the host replaying a segment after each (host); eager on a CPU
    (SLUICE_TEST_DEVICE=cuda captures and replays them). Greedy tokens are the reference's, the logits direct's within
    the golden tolerance, the CPU computed blocks in the replayed steps (a host span each in the trace), no wait on the
    device gave up."""
    from sluice.stages.table_cpu import CpuSteps
    from test_whole import _open

    turns, wait = [], CpuSteps._await_seq  # the host's turns between segments, by token

    def counted(self, seq, value):
        turns.append(value)
        wait(self, seq, value)
    monkeypatch.setattr(CpuSteps, "_await_seq", counted)
    variant = "nemotron_h_latent"
    plain = direct_schedule(tmp_path, "plain", backend="triton", refresh=2)
    hybrid = direct_schedule(tmp_path, "hybrid", backend="triton", refresh=2, cpu_share=0.5, cpu_compile=False,
                             cpu_wait=cpu_wait)
    with _open(stores[variant], plain, True, vram_slots=4) as engine:
        want = greedy_logits(engine, PROMPT, STEPS)
    trace = tmp_path / "t.json"
    with _open(stores[variant], hybrid, True, vram_slots=4, trace=str(trace)) as engine:
        got = greedy_logits(engine, PROMPT, STEPS)
        replays, cpu = engine.whole.replays, engine.rt.stats.cpu_blocks
        before = cpu
        greedy_logits(engine, PROMPT[:4], 3)  # a second sequence: its replays compute CPU rows too
        after = engine.rt.stats.cpu_blocks
        gave_up = int(engine.coordinator.plan.table._cpu_gave_up[0][0])
    assert replays > 0 and cpu > 0 and after > before and len(set(turns)) >= replays and gave_up == 0
    spans = [json.loads(line) for line in (tmp_path / "t.json.jsonl").read_text().splitlines()]
    steps = {line["step"] for line in spans if line.get("stage") == "compute:cpu"}
    assert set(range(2, STEPS)) <= steps  # the CPU's share in the replayed steps' trace, not only a sequence's first step
    assert sum(line["blocks"] for line in spans if line.get("stage") == "compute:cpu") == after  # each call's blocks
    assert [int(t) for t in got.argmax(-1)] == refs.greedy(variant, PROMPT, STEPS)
    assert_logits_close(variant, got, want, f"the CPU's share in a whole step (cpu_wait: {cpu_wait})")


def rate_of(block_s: float):
    from sluice.kernels.rates import CpuRate

    rate = CpuRate()
    rate.set(block_s)
    return rate


class _Rule:
    """The table's choice of a token's step (`CpuSteps.cpu_choose`) on measured rates and counts alone."""

    def __init__(self, outside: dict[int, int], cpu_s: float = 0.18e-3, copy_s: float = 0.10e-3, wait: str = "device"):
        from types import SimpleNamespace

        from sluice.stages.table_cpu import CpuSteps

        self.cpu = type("T", (CpuSteps,), {"copy_s": lambda self: copy_s})()
        self.cpu.__dict__.update(cpu_share=0.3, cpu_now=True, _cpu_plain=0, _cpu_retimed=False, _cpu_forced=False, _cpu_probe=0,
                                 _cpu_outside=outside,
                                 layers=list(range(23)),
                                 knobs=SimpleNamespace(cpu_balance=True, cpu_wait=wait),
                                 rt=SimpleNamespace(cpu_rate=rate_of(cpu_s), device=torch.device("cuda")))

    def tokens(self, n: int) -> list[bool]:
        return [self.cpu.cpu_choose() for _ in range(n)]


@pytest.mark.parametrize("wait", ["device", "host"])
def test_the_cpus_share_runs_where_it_pays(wait, monkeypatch):
    """Balanced, a token runs with the CPU's share while the blocks its layers had outside VRAM, split by the rates,
    save more than its turns cost (the GPU's waits for the host, or the segments' ends): ~5 a layer (uniform routing at
    8 GiB) do, 1-2 (skewed) do not, and then the share is tried again every PROBE tokens (which refreshes the counts);
    with no counts yet, or a fixed share, with it. The must-fail side: had the rule ignored the turns' cost, skewed
    counts would keep the share on."""
    from sluice.stages import table_cpu
    from sluice.stages.table_cpu import PROBE

    assert all(_Rule({i: 5 for i in range(23)}, wait=wait).tokens(40))
    skewed = _Rule({i: 1 + i % 2 for i in range(23)}, wait=wait).tokens(PROBE + 2)
    assert skewed[:PROBE] == [False] * PROBE and skewed[PROBE] and not skewed[PROBE + 1]
    assert all(_Rule({}, wait=wait).tokens(3))
    fixed = _Rule({i: 1 for i in range(23)}, wait=wait)
    fixed.cpu.knobs.cpu_balance = False
    assert all(fixed.tokens(3))
    monkeypatch.setattr(table_cpu, "TURN_S" if wait == "host" else "WAIT_S", 0.0)
    assert all(_Rule({i: 1 + i % 2 for i in range(23)}, wait=wait).tokens(4))


def test_a_token_run_whole_without_the_cpus_share_between_segmented_ones(stores, refs, tmp_path, monkeypatch):
    """Tokens whose table chose no CPU share replay the step captured without it, beside the segmented one (one
    capture each, both keyed by the sequence's state): greedy tokens the reference's, logits direct's within the
    golden tolerance, the CPU's blocks counted only in segmented tokens."""
    from sluice.stages.table_cpu import CpuSteps
    from test_whole import _open

    variant, steps = "nemotron_h_latent", 6
    plain = direct_schedule(tmp_path, "plain", backend="triton", refresh=2)
    hybrid = direct_schedule(tmp_path, "hybrid", backend="triton", refresh=2, cpu_share=0.5, cpu_compile=False)
    with _open(stores[variant], plain, True, vram_slots=4) as engine:
        want = greedy_logits(engine, PROMPT, steps)
    chosen = []

    def alternate(self):
        self.cpu_now = len(chosen) % 3 != 2  # every third token whole without the CPU's share
        chosen.append(self.cpu_now)
        return self.cpu_now
    monkeypatch.setattr(CpuSteps, "cpu_choose", alternate)
    with _open(stores[variant], hybrid, True, vram_slots=4) as engine:
        got = greedy_logits(engine, PROMPT, steps)
        keys = {key[1] for key in engine.whole._seen}
    assert False in chosen and True in chosen and keys == {True, False}
    assert [int(t) for t in got.argmax(-1)] == refs.greedy(variant, PROMPT, steps)
    assert_logits_close(variant, got, want, "the CPU's share in some tokens, whole without it in others")


def test_a_cpu_given_no_blocks_is_timed_again():
    """Balanced, a rate timed too slow at first use gives the CPU no block in any layer, and a CPU given none would
    never be timed again: the next token runs with the share at once, its counts two blocks in each layer with two or
    more outside VRAM (its calls re-time it); still slow, only the probes run it; a rate that gives it blocks somewhere
    keeps the balance's counts. The must-fail side: the balance alone leaves it none."""
    from sluice.stages.h2d import balance_cpu_blocks

    from sluice.stages.table_cpu import PROBE

    slow = _Rule({i: 5 - (i % 5 == 4) * 4 for i in range(23)}, cpu_s=0.7e-3)  # 5 blocks outside VRAM, every fifth 1
    assert not any(balance_cpu_blocks(n, 0.10e-3, 0.7e-3) for n in slow.cpu._cpu_outside.values())
    assert slow.tokens(1) == [True]  # at once, not at the next probe: the counts below re-time the CPU
    assert slow.cpu.cpu_counts(6) == [[0, 0, 2, 2, 2, 2, 2]] * 23 and slow.cpu._cpu_forced  # by the blocks outside VRAM
    assert slow.tokens(1) == [True]  # not yet re-timed (the CPU's rows of such counts do it: `_cpu_rows`)
    slow.cpu._cpu_retimed = True
    assert slow.tokens(PROBE + 1) == [False] * PROBE + [True]  # still slow once re-timed: only the probes
    fast = _Rule({i: 5 for i in range(23)})
    assert fast.cpu.cpu_counts(6) == [[balance_cpu_blocks(n, 0.10e-3, 0.18e-3) for n in range(7)]] * 23
    assert fast.cpu.cpu_counts(6)[0][5] == 2 and not fast.cpu._cpu_forced


def test_every_probe_gives_the_cpu_one_block_more():
    """Balanced, every PROBE-th token with the CPU's share gives it one block more than the balance wherever there is
    one, so that a count the balance stopped giving is timed again as things are now (an H100 host, 2026-12-07: three
    calls of two blocks at 0.82 ms, slowed beside PCIe's reads, left the CPU one block a layer for the run, 58 tok/s
    where runs with two made 68). The must-fail side: the balance's own counts never time two."""
    from sluice.stages.h2d import balance_cpu_blocks
    from sluice.stages.table_cpu import PROBE

    rule = _Rule({i: 5 for i in range(23)}, cpu_s=0.333e-3, copy_s=0.105e-3)
    balance = [balance_cpu_blocks(n, 0.105e-3, 0.333e-3) for n in range(7)]
    assert balance[5] == 1
    rows = [rule.cpu.cpu_counts(6)[0] for _ in range(2 * PROBE)]
    assert rows.count(balance) == 2 * PROBE - 2
    assert rows[PROBE - 1] == rows[-1] == [0] + [min(n, c + 1) for n, c in enumerate(balance)][1:]
    assert rows[PROBE - 1][5] == 2  # the count the balance would not give


def test_the_device_split_takes_the_count_for_this_tokens_blocks_outside_vram():
    """A whole step's split on the device gives the CPU the lowest-ranked routed blocks outside VRAM, as many as the
    layer's row of counts says for how many are outside this token (the row [0, 0, 1, 1, 2, 2, 3]: 6 outside -> 3, 2
    -> 1), their offsets pointed at the zero block. The must-fail side: one count a layer made from the token before
    (3, when it had 6 outside) sends both of this token's 2 to the CPU and none over PCIe."""
    from types import SimpleNamespace

    from sluice.stages.table_cpu import CpuSteps

    K, dx = 6, 4
    in_vram = torch.zeros(1, 8, dtype=torch.int64)
    bufs = SimpleNamespace(pack=torch.zeros(4 * K + dx), seq=torch.zeros(1, dtype=torch.int64))
    t = CpuSteps.__new__(CpuSteps)
    t.__dict__.update(tier=SimpleNamespace(in_vram=in_vram), _cpu_buffers=lambda i, block, dx, x: bufs)

    def split(row, vram):
        t._cpu_dev = (torch.tensor([row]), torch.tensor([7]), torch.tensor(-1))
        in_vram.zero_()
        in_vram[0, vram] = 1
        v = {"ids": torch.arange(K)[None], "offs": torch.arange(100, 100 + K), "weights": torch.ones(1, K),
             "xe": torch.zeros(1, dx), "x": torch.zeros(1, dx)}
        t.cpu_split(v, SimpleNamespace(i=0, block=None))
        assert int(bufs.seq[0]) == 7 and bufs.pack[-K:].tolist() == [0.0 if k in vram else 1.0 for k in range(K)]
        return v["cpu_mask"].tolist(), v["offs"].tolist()

    balanced = [0, 0, 1, 1, 2, 2, 3]
    assert split(balanced, []) == ([False] * 3 + [True] * 3, [100, 101, 102, -1, -1, -1])
    assert split(balanced, [0, 1, 2, 3]) == ([False] * 5 + [True], [100, 101, 102, 103, 104, -1])
    assert split([3] * 7, [0, 1, 2, 3])[0] == [False] * 4 + [True] * 2  # a count of the token before


def test_the_cpus_rate_parts_a_calls_overhead_from_its_blocks():
    """The CPU's rate is a line through each count's average call: calls of 1 and 4 blocks at 0.10 ms a call and
    0.15 ms a block give those parts back, and the balance then sends a layer with 5 blocks outside VRAM two of them
    (0.40 ms on the CPU beside three copies' 0.36 at 0.12 ms a copy); one count alone, or noise that slopes the line
    down, puts every second on the blocks. The must-fail side: per block alone (the one-block calls' 0.25 ms), the
    balance sends the CPU one block, and with no calls of more than one never learns better."""
    from sluice.kernels.rates import CpuRate
    from sluice.stages.h2d import balance_cpu_blocks

    rate = CpuRate()
    for _ in range(3):
        rate.observe(1, 0.25e-3)
        rate.observe(4, 0.70e-3)
    assert rate.block_s == pytest.approx(0.15e-3) and rate.call_s == pytest.approx(0.10e-3)
    assert rate.seconds(2) == pytest.approx(0.40e-3) and rate.seconds(0) == 0
    assert balance_cpu_blocks(5, 0.12e-3, rate.block_s, rate.call_s) == 2
    assert balance_cpu_blocks(5, 0.12e-3, 0.25e-3) == 1  # the one-block figure as a rate per block
    rate.observe(1, 5e-3)  # one stalled call moves nothing: a count's figure is its calls' lower median
    assert rate.by_count()[1] == (pytest.approx(0.25e-3), 4) and rate.block_s == pytest.approx(0.15e-3)
    one = CpuRate()
    one.observe(2, 0.5e-3)
    assert (one.block_s, one.call_s) == (pytest.approx(0.25e-3), 0.0)
    down = CpuRate()
    down.observe(1, 0.5e-3)
    down.observe(3, 0.3e-3)  # slower for fewer: noise; the line through 0 (0.5 + 0.9) / (1 + 9)
    assert (down.block_s, down.call_s) == (pytest.approx(0.14e-3), 0.0)
    assert balance_cpu_blocks(3, 0.1, 0.7, call=0.0) == 0 and balance_cpu_blocks(10, 0.1, 0.1, call=0.3) == 3


def test_one_stalled_call_cannot_hold_the_cpus_rate():
    """As measured on an H100 host (2026-12-07): the calibration's one and four blocks, then a layer's calls of one block
    at 0.19 ms and one call of two stalled at 2.83 ms. The stalled count stays out of the line until its second call
    (the calibration's four blocks stand for theirs), so a layer with 5 blocks outside VRAM still gives the CPU two. The
    must-fail side: the line through every count's calls, the stalled one's too, charges 0.25 ms a block, which gives
    the CPU one block a layer, so that count 2 is never timed again."""
    from sluice.kernels.rates import CpuRate
    from sluice.stages.h2d import balance_cpu_blocks

    rate = CpuRate()
    rate.give(1, 0.17e-3)
    rate.give(4, 0.40e-3)
    for _ in range(50):
        rate.observe(1, 0.19e-3)
    rate.observe(2, 2.83e-3)
    assert rate.call_s == pytest.approx(0.12e-3) and rate.block_s == pytest.approx(0.07e-3)
    assert balance_cpu_blocks(5, 0.102e-3, rate.block_s, rate.call_s) == 2
    every = CpuRate._fit({1: (0.19e-3, 8), 2: (2.83e-3, 1), 4: (0.40e-3, 1)})
    assert every[0] == pytest.approx(0.254e-3, rel=0.01) and balance_cpu_blocks(5, 0.102e-3, *every) == 1
    rate.observe(2, 0.30e-3)  # its second call: the lower median of the two
    assert rate.by_count()[2] == (pytest.approx(0.30e-3), 2)


def test_a_stalled_calibration_yields_to_the_engines_calls():
    """As measured on an H200 host (2026-12-07): the calibration's best of three stalled as a whole (16.8 ms for one
    block and for four), then the engine's calls of two blocks took 0.40 ms. A given figure that the counts timed belie
    (one block slower than two; four slower than two calls of two) leaves the line: 0.20 ms a block, and a layer with 5
    blocks outside VRAM gives the CPU two. The must-fail side: the line through the stalled figures charges 1.84 ms a
    block and gives the CPU none."""
    from sluice.kernels.rates import CpuRate
    from sluice.stages.h2d import balance_cpu_blocks

    rate = CpuRate()
    rate.give(1, 16.784e-3)
    rate.give(4, 16.782e-3)
    assert rate.block_s == pytest.approx((16.784e-3 + 4 * 16.782e-3) / 17)  # nothing timed: the given figures stand
    for _ in range(8):
        rate.observe(2, 0.401e-3)
    assert (rate.block_s, rate.call_s) == (pytest.approx(0.2005e-3), 0.0)
    assert balance_cpu_blocks(5, 0.102e-3, rate.block_s, rate.call_s) == 2
    stalled = CpuRate._fit({1: (16.784e-3, 1), 2: (0.401e-3, 8), 4: (16.782e-3, 1)})
    assert stalled[0] == pytest.approx(1.84e-3, rel=0.01) and balance_cpu_blocks(5, 0.102e-3, *stalled) == 0


def test_a_count_timed_a_few_times_yields_to_one_timed_often():
    """As measured on an H100 host (2026-12-07): 2643 calls of one block at 0.333 ms and three of two at 0.82 (slower
    than two calls of one): the two-block figure leaves the line, which charges a block 0.333 ms; in another run two
    calls of three blocks stalled at 8.4 ms beside 86 of two at 0.307 and the calibration's one at 0.122: without the
    three, 0.153 ms a block, and a layer with 5 blocks outside VRAM gives the CPU two. The must-fail side: the line
    through the stalled count gives the CPU none."""
    from sluice.kernels.rates import CpuRate
    from sluice.stages.h2d import balance_cpu_blocks

    rate = CpuRate()
    for _ in range(2643):
        rate.observe(1, 0.333e-3)
    for _ in range(3):
        rate.observe(2, 0.82e-3)
    assert (rate.block_s, rate.call_s) == (pytest.approx(0.333e-3), 0.0)
    assert rate.by_count()[2] == (pytest.approx(0.82e-3), 3)  # still printed, out of the line
    stalled = CpuRate()
    stalled.give(1, 0.122e-3)
    for _ in range(86):
        stalled.observe(2, 0.307e-3)
    for _ in range(2):
        stalled.observe(3, 8.448e-3)
    assert stalled.block_s == pytest.approx((0.122e-3 + 8 * 2 * 0.307e-3) / (1 + 8 * 4))
    assert balance_cpu_blocks(5, 0.105e-3, stalled.block_s, stalled.call_s) == 2
    every = CpuRate._fit({1: (0.122e-3, 1), 2: (0.307e-3, 8), 3: (8.448e-3, 2)})
    assert balance_cpu_blocks(5, 0.105e-3, *every) == 0
