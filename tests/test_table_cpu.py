"""The fast path's hybrid miss path (compute's `cpu_share`, stages/table_cpu.py): of a one-token step's blocks outside
VRAM the CPU computes a share from their RAM slots while the GPU kernels read the rest; its rows join the GPU's in
combine's fixed-order sum."""
from __future__ import annotations

import pytest

import sluice
from sluice.errors import ScheduleError
from common import DEVICE, PROMPT, assert_logits_close, greedy_logits
from test_direct import direct_schedule

STEPS = 6


@pytest.mark.parametrize("variant", ["nemotron_h_latent", "gpt_oss"])
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


def test_cpu_share_in_a_whole_step_of_segments(stores, refs, tmp_path, monkeypatch):
    """A whole step with the CPU's share runs in segments (pipeline/whole.py): the split made on the device (the
    lowest-ranked blocks outside VRAM, up to each layer's count), the host's turn between segments computing the CPU's
    rows; eager on a CPU (SLUICE_TEST_DEVICE=cuda captures and replays them). Greedy tokens are the reference's, the
    logits direct's within the golden tolerance, the CPU computed blocks in the replayed steps."""
    from sluice.stages.table_cpu import CpuSteps
    from test_whole import _open

    turns, wait = [], CpuSteps._await_seq  # the host's turns between segments, by token

    def counted(self, seq, value):
        turns.append(value)
        wait(self, seq, value)
    monkeypatch.setattr(CpuSteps, "_await_seq", counted)
    variant = "nemotron_h_latent"
    plain = direct_schedule(tmp_path, "plain", backend="triton", refresh=2)
    hybrid = direct_schedule(tmp_path, "hybrid", backend="triton", refresh=2, cpu_share=0.5, cpu_compile=False)
    with _open(stores[variant], plain, True, vram_slots=4) as engine:
        want = greedy_logits(engine, PROMPT, STEPS)
    with _open(stores[variant], hybrid, True, vram_slots=4) as engine:
        got = greedy_logits(engine, PROMPT, STEPS)
        replays, cpu = engine.whole.replays, engine.rt.stats.cpu_blocks
        before = cpu
        greedy_logits(engine, PROMPT[:4], 3)  # a second sequence: its replays compute CPU rows too
        after = engine.rt.stats.cpu_blocks
    assert replays > 0 and cpu > 0 and after > before and len(set(turns)) >= replays
    assert [int(t) for t in got.argmax(-1)] == refs.greedy(variant, PROMPT, STEPS)
    assert_logits_close(variant, got, want, "the CPU's share, whole step in segments")
