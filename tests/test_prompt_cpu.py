"""A prompt's blocks of few rows on the CPU (h2d's `prompt_cpu`, the `via: table` stages): of a prompt step's blocks
outside VRAM, those routed to few of its rows are computed by the CPU from their RAM slots while the others cross
PCIe, and the layer before does not copy them ahead; their rows join the GPU's in combine's fixed-order sum."""
from __future__ import annotations

import pytest

import sluice
from common import DEVICE, PROMPT, assert_logits_close, greedy_logits
from test_direct import direct_schedule

STEPS = 4


def _run(store, schedule, rates=None, monkeypatch=None):
    """Greedy logits of PROMPT and STEPS - 1 decode steps, a second prompt's logits, the I/O counters; `rates`: the
    CPU's seconds a row and a call and PCIe's a block, which `prompt_cpu: -1` balances (none are measured on a CPU)."""
    from sluice.stages.table import Table

    if rates is not None:
        monkeypatch.setattr(Table, "prompt_rates", lambda self, block, dx: rates[:2])
    with sluice.load(store, device=DEVICE, schedule=schedule, vram_slots=4) as engine:
        if rates is not None:
            engine.rt.h2d_bps = engine.store.block_bytes / rates[2]
        logits = greedy_logits(engine, PROMPT, STEPS)
        again = engine.forward(PROMPT[::-1])
        return logits, again, engine.rt.stats.snapshot()


@pytest.mark.parametrize("variant", ["nemotron_h_latent", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_a_prompts_blocks_of_few_rows_on_the_cpu_give_the_direct_logits(variant, stores, refs, tmp_path, monkeypatch):
    """With the CPU taking every RAM block of at most 2 rows (and the layer before copying only the others ahead): the
    prompt's logits transformers', the decode's greedy tokens the reference's, every logit direct's without it within
    the golden tolerance (the CPU's kernels round their own way); the CPU's rows weighted twice over are caught."""
    from sluice.kernels.cpu import CpuExperts
    from sluice.stages.compute_table import ComputeTable

    layers, beside = [], ComputeTable.beside_cpu  # per prompt layer: (its blocks copied ahead, the CPU's)

    def logged(self, v):
        layers.append((len(v["ahead"]), len(v.get("cpu") or ())))
        return beside(self, v)
    monkeypatch.setattr(ComputeTable, "beside_cpu", logged)
    knobs = dict(backend="triton", refresh=2, prompt_group=2, cpu_compile=False)
    plain = direct_schedule(tmp_path, "plain", **knobs)
    on_cpu = direct_schedule(tmp_path, "on-cpu", prompt_cpu=2, **knobs)
    want, want_again, io_plain = _run(stores[variant], plain)
    assert io_plain["cpu_blocks"] == 0 and not any(cpu for _, cpu in layers)
    layers.clear()
    got, got_again, io = _run(stores[variant], on_cpu)
    assert io["cpu_blocks"] == sum(cpu for _, cpu in layers) > 0 and io["cpu_prompt_s"] > 0
    assert any(ahead and cpu for ahead, cpu in layers)  # the layer before copied the others ahead, left these
    assert [int(t) for t in got.argmax(-1)] == refs.greedy(variant, PROMPT, STEPS)
    assert_logits_close(variant, got[0], refs.logits(variant, PROMPT)[-1], f"{variant}: a prompt with the CPU's blocks")
    assert_logits_close(variant, got, want, f"{variant}: decode after a prompt with the CPU's blocks")
    assert_logits_close(variant, got_again, want_again, f"{variant}: a second prompt with the CPU's blocks")

    pairs = CpuExperts.weighed_pairs
    monkeypatch.setattr(CpuExperts, "weighed_pairs", lambda self, blocks, x, w, *a: pairs(self, blocks, x, 2 * w, *a))
    wrong, _, _ = _run(stores[variant], on_cpu)
    with pytest.raises(AssertionError, match="max \\|dlogit\\|"):
        assert_logits_close(variant, wrong, want, "the CPU's rows weighted twice")


def test_the_rates_choose_the_cpus_blocks_of_a_prompt(stores, refs, tmp_path, monkeypatch):
    """`prompt_cpu: -1`: a CPU as fast a row as PCIe a block takes blocks (the logits still the reference's); one slower
    than all the copies together takes none."""
    variant = "nemotron_h_latent"
    schedule = direct_schedule(tmp_path, "rated", backend="triton", prompt_group=2, cpu_compile=False, prompt_cpu=-1)
    fast, _, io = _run(stores[variant], schedule, (1e-4, 0.0, 1e-4), monkeypatch)
    assert io["cpu_blocks"] > 0
    assert [int(t) for t in fast.argmax(-1)] == refs.greedy(variant, PROMPT, STEPS)
    _, _, io = _run(stores[variant], schedule, (1.0, 0.0, 1e-4), monkeypatch)
    assert io["cpu_blocks"] == 0


@pytest.mark.parametrize("counts, tg, tc, call, next_row, want", [
    ([1, 1, 2, 5, 9], 1.0, 0.5, 0.0, None, 2),  # 4 rows: 2 s on the CPU beside 2 blocks copied
    ([1, 1, 2, 5, 9], 1.0, 5.0, 0.0, None, 0),  # a row slower than all the copies: none
    ([3, 3, 3, 3], 1.0, 0.25, 0.0, None, 3),  # every block of a count goes, or none
    ([1, 1, 1, 1], 1.0, 1.0, 0.0, None, 0),  # 4 s either way: a tie keeps the fewer
    ([1, 1, 4], 1.0, 1.0, 0.5, None, 1),  # 2.5 s with the two, 3 s with none
    ([2, 2, 2, 2], 1.0, 0.5, 0.0, None, 0),  # 8 rows at 0.5 s: 4 s, a tie with the copies
    ([2, 2, 2, 2], 1.0, 0.5, 0.0, 0.1, 2),  # a block's second row at 0.1 s: 2.4 s for all four
    ([], 1.0, 1.0, 0.0, None, 0),
])
def test_the_balance_takes_the_blocks_that_finish_soonest(counts, tg, tc, call, next_row, want):
    from sluice.stages.h2d_table import balance_prompt_cpu

    assert balance_prompt_cpu(counts, tg, tc, call, next_row) == want


def test_the_prompt_rate_prices_a_blocks_first_row_and_its_next_apart():
    """kernels/rates.py PairRate: calls over b blocks and r rows fitted as call + b * first + (r - b) * next; a call
    part that fits below 0 is dropped; calls of one-row blocks alone price the next rows as first ones."""
    from sluice.kernels.rates import PairRate

    rate = PairRate()
    assert rate.parts() is None
    for b, r in [(4, 4), (6, 10), (3, 12), (8, 9), (5, 20)]:
        rate.observe(b, r, 2e-4 + b * 1e-4 + (r - b) * 3e-5)
    assert rate.parts() == pytest.approx((1e-4, 2e-4, 3e-5))
    late = PairRate()
    for b, r in [(4, 4), (6, 10), (3, 12)]:
        late.observe(b, r, -1e-4 + b * 1e-4 + (r - b) * 3e-5)  # a negative call: fitted without one
    first, call, nxt = late.parts()
    assert call == 0.0 and first > 0 and nxt > 0
    ones = PairRate()
    for b in (2, 5, 7):
        ones.observe(b, b, b * 1e-4)
    assert ones.parts() == pytest.approx((1e-4, 0.0, 1e-4))


def test_a_failure_as_the_cpus_rows_start_leaves_no_tier_slot_filled(stores, tmp_path, monkeypatch):
    """A prompt step that fails as it starts the CPU's rows, after h2d's plan took free VRAM tier slots (none filled at
    open) for its copies, gives them back: the next prompt's logits are those of a run on the same tier that never
    failed."""
    from sluice.stages.table import Table
    from test_direct import table_of

    variant, knobs = "nemotron_h_latent", dict(backend="triton", refresh=2, prompt_group=2, cpu_compile=False)
    schedule = direct_schedule(tmp_path, "on-cpu", prompt_cpu=2, vram_fill=False, **knobs)
    with sluice.load(stores[variant], device=DEVICE, schedule=schedule, vram_slots=12) as engine:
        engine.empty_vram()
        want = engine.forward(PROMPT)
        engine.empty_vram()
        tier, kernels = table_of(engine).tier, Table.cpu_kernels
        held = dict(tier.slot_of)
        monkeypatch.setattr(Table, "cpu_kernels", lambda self, block: (_ for _ in ()).throw(RuntimeError("no CPU kernels")))
        with pytest.raises(RuntimeError, match="no CPU kernels"):
            engine.forward(PROMPT)
        assert tier.slot_of == held  # the failed step's slots given back
        monkeypatch.setattr(Table, "cpu_kernels", kernels)
        assert_logits_close(variant, engine.forward(PROMPT), want, "a prompt after a failed one")


def test_a_batchs_decode_rows_routed_on_the_host_stay_on_the_gpu(stores, tmp_path):
    """`prompt_cpu` is for prompts: a batched step's decode rows routed on the host (`batch_rows: host`) give the CPU
    none of their blocks, however few rows each has; the prompts before them do."""
    schedule = direct_schedule(tmp_path, "rows-host", backend="triton", refresh=2, prompt_group=2, cpu_compile=False,
                               prompt_cpu=2, batch_rows="host")
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, schedule=schedule, vram_slots=4) as engine:
        seqs = [engine.new_sequence() for _ in range(2)]
        last = [int(engine.extend(s, p)[-1].argmax()) for s, p in zip(seqs, (PROMPT, PROMPT[::-1]))]
        prompts = engine.rt.stats.cpu_blocks
        for _ in range(2):
            last = [int(l[-1].argmax()) for l in engine.extend_many(seqs, last)]
        assert prompts > 0 and engine.rt.stats.cpu_blocks == prompts
