"""The Python API: load, forward, generate, stream, sampling, settings, traces."""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from sluice.errors import ConfigError, ScheduleError, SluiceError, StoreError
from sluice.pipeline.config import parse_size
from sluice.pipeline.sampling import Sampler
from sluice.stages import STAGES
from common import DEVICE, PROMPT


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


def test_warm_up_leaves_no_state(stores, tmp_path):
    """`warm_up` (what `sluice serve` runs before serving) runs a prompt and one-token steps on a sequence of its own:
    the logits and greedy tokens afterwards are those of an engine that never warmed up, and the VRAM tier is empty."""
    with sluice.load(stores["qwen3_moe"], device=DEVICE, vram_slots=4) as engine:
        want, tokens = engine.forward(PROMPT), engine.generate(PROMPT, 6)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, vram_slots=4) as engine:
        assert engine.warm_up(24, decode_tokens=3) > 0
        assert engine.rt.stats.steps > 0 and len(engine.rt.vram) == 0
        assert torch.equal(engine.forward(PROMPT), want) and engine.generate(PROMPT, 6) == tokens
        seen = engine.rt.stats.tokens
        engine.warm_up(10**6, decode_tokens=2)  # cut to the model's context, the decode steps included
        context = engine.model.config.max_position_embeddings
        assert engine.rt.stats.tokens - seen == context - 2 + 1  # the prompt, then the first new token fed back


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
    with pytest.raises(ConfigError, match="vram_slots and vram_budget: give one"):
        sluice.load(stores["qwen3_moe"], vram_slots=4, vram_budget="8GiB")
    with pytest.raises(ConfigError, match="vram_budget: cannot read '8 gigs'"):
        sluice.load(stores["qwen3_moe"], vram_budget="8 gigs")
    with pytest.raises(ConfigError, match="vram_reserve: it sizes a VRAM budget's reserve"):
        sluice.load(stores["qwen3_moe"], vram_reserve="1GiB")
    with pytest.raises(ConfigError, match="vram_reserve: cannot read 'some'"):
        sluice.load(stores["qwen3_moe"], vram_budget="8GiB", vram_reserve="some")
    with sluice.load(stores["qwen3_moe"], device=DEVICE) as engine:
        with pytest.raises(SluiceError, match="empty"):
            engine.generate([], 3)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, vram_budget="card", vram_slots=4) as engine:  # the CLI's default
        assert engine.config.vram_budget is None and engine.config.vram_slots == 4  # slots given: no budget beside them
    with sluice.load(stores["qwen3_moe"], device=DEVICE, vram_budget="card") as engine:  # the card's, on a GPU
        assert (engine.config.vram_budget is not None) == (engine.device.type == "cuda")
    assert parse_size("1.5GiB", "x") == 1536 * 1024**2 and parse_size("512MB", "x") == 512 * 10**6


def test_trace_files(stores, tmp_path):
    trace = tmp_path / "t.json"
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, trace=str(trace), ram_cache="64KiB") as engine:
        engine.generate(PROMPT, 3)
        summary = engine.rt.tracer.summary()
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    streaming = set(STAGES) - {"direct"}  # the overlap schedule: every stage but direct
    assert names == streaming  # span names are the stage file names
    assert {e["tid"] for e in events if e.get("ph") == "X" and e["pid"] == 1} == {f"host/{n}" for n in streaming}
    assert any(e["name"] == "read" and e["ph"] == "b" for e in events)
    lines = [json.loads(l) for l in (tmp_path / "t.json.jsonl").read_text().splitlines()]
    host = [l for l in lines if l["event"] == "stage"]
    assert {l["stage"] for l in host} == streaming and all(l["host_us"] >= 0 for l in host)
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
    from sluice.benchmarks.model import bench_model, format_bench

    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        r = bench_model(engine, prompt_lengths=(8,), decode_tokens=4)
        text = format_bench(r, engine.store.block_bytes)
    d = r["decode"]
    assert r["prefill"][8]["tok_s"] > 0 and d["tokens"] == 4 and d["tok_s"] > 0
    assert len(d["step_ms"]) == 4 and abs(d["ms_first_token"] - d["step_ms"][0]) < 1e-3
    # how each timed step ran: whole steps (replayed: the untimed runs captured them) where the engine has them
    assert d["step_kinds"] == (["replayed"] * 4 if engine.whole is not None else [""] * 4), d["step_kinds"]
    assert sum(d["blocks_per_token"].values()) == 3 * 4  # 3 MoE layers x top-4, every decode step
    assert "decode:" in text and "hit rate" in text
    d.update(cpu_blocks_per_token=2.0, cpu_ms_per_block=0.15, cpu_ms_per_call=0.1, cpu_calls={1: [0.25, 3], 4: [0.7, 3]})
    assert "the CPU's calls: 1 blocks 0.250 ms (3 timed), 4 blocks 0.700 ms (3 timed)" in format_bench(r, 1 << 20)
    d.update(step_ms=[9.0, 85.7, 9.1, 9.2], step_kinds=["replayed", "captured", "replayed", "layer by layer"],
             step_cpu_blocks=[3, 0, 2, 3])
    assert ("slowest steps: #1 85.7 ms (captured, 0 blocks on the CPU), #3 9.2 ms (layer by layer, 3 blocks on the CPU), "
            "#2 9.1 ms (replayed, 2 blocks on the CPU)") in format_bench(r, 1 << 20)
    d.update(cpu_blocks_per_token=0)  # no CPU share: the kinds alone
    assert "slowest steps: #1 85.7 ms (captured), #3 9.2 ms (layer by layer), #2 9.1 ms (replayed)" in format_bench(r, 1 << 20)
    p = r["prefill"][8]  # a prompt's blocks copied over PCIe, and on CUDA their floor beside the prompt's time
    assert p["pcie_blocks"] == p["blocks"]["ram"] + p["blocks"]["disk"] - p["cpu_blocks"] > 0
    p.update(s=0.30, pcie_floor_s=0.25, cpu_blocks=7, cpu_s=0.125)
    p["next"].update(s=0.29, pcie_floor_s=0.20)
    row = next(line for line in format_bench(r, 1 << 20).splitlines() if line.startswith("       8 "))
    assert row.endswith("; of the RAM blocks on the CPU 0 in 0.000 s (first: 7 in 0.125 s); PCIe floor 0.250 s (1.20 x), "
                        "next 0.200 s (1.45 x)"), row


def test_bench_model_cold_times_from_empty_caches(stores):
    """`--cold`: each timed prompt and the decode start from empty expert caches (the untimed runs before them only
    compile), so every block a timed prompt routes to comes from disk; warm, none does."""
    from sluice.benchmarks.model import bench_model

    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, schedule="overlap") as engine:  # a streaming one
        # 12 tokens: the 12th routes to a block its prompt did not (a demand read from disk, whatever the timing: in 4
        # tokens the only read was a guess, whose issue depends on when the reader is idle)
        cold = bench_model(engine, prompt_lengths=(8,), decode_tokens=12, warm=False)
        warm = bench_model(engine, prompt_lengths=(8,), decode_tokens=4)
        engine.drop_caches()
        assert len(engine.rt.ram.entries()) == 0
    first = cold["prefill"][8]["blocks"]
    assert first["disk"] > 0 and first["ram"] == first["vram"] == 0
    assert warm["prefill"][8]["blocks"]["disk"] == 0 and warm["decode"]["blocks_per_token"]["disk"] == 0
    assert cold["decode"]["disk_reads_per_token"] > 0  # blocks its 32-token prompt did not route to
    # the drive's busy time: while its reads were on it, within the decode time; none warm
    assert 0 < cold["decode"]["disk_busy_share"] <= 1 and cold["decode"]["disk_busy_ms_per_token"] > 0
    # its reads timed by kind: here all guesses (the demands found them read or on their way); none warm
    assert cold["decode"]["guess_read_drive_ms"] > 0 and cold["decode"]["guess_read_queued_ms"] >= 0
    assert warm["decode"]["guess_read_drive_ms"] is None and warm["decode"]["demand_read_drive_ms"] is None
    assert warm["decode"]["disk_reads_per_token"] == 0 and warm["decode"]["disk_busy_ms_per_token"] == 0


def test_disk_bandwidth_reads_through_a_reader_of_its_own(stores, monkeypatch):
    """The roofline's disk rate: the engine's reader depth, reads that skip the checksums (not the drive's work), and
    neither the engine's read counters nor its cache touched."""
    from sluice.benchmarks.model import disk_bandwidth

    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        before, cached = (engine.rt.reader.reads, engine.rt.reader.bytes_read), len(engine.rt.ram.entries())
        monkeypatch.setattr(engine.store, "digest", lambda *a: pytest.fail("a checksum was computed"))
        assert disk_bandwidth(engine, blocks=8) > 0
        assert (engine.rt.reader.reads, engine.rt.reader.bytes_read) == before and len(engine.rt.ram.entries()) == cached


def test_profile_table_lists_gpu_ops_by_time_per_token():
    """bench --profile's GPU table: ops by own time, per token, the ops past its rows summed in one line."""
    from types import SimpleNamespace

    from sluice.benchmarks.profile import device_table

    ops = [SimpleNamespace(key=f"op{i}", self_device_time_total=100.0 * i, count=2 * i) for i in range(1, 6)]
    lines = device_table(ops, tokens=2, rows=3).splitlines()
    assert lines[1].split() == ["0.250", "5.0", "50.00", "op5"]  # 500 us over 2 tokens, 10 calls
    assert lines[3].split()[-1] == "op3" and lines[4].split()[:2] == ["0.150", "3.0"]  # op2 + op1: 300 us, 6 calls


def test_copy_timeline_finds_where_pcie_idles():
    """bench --profile's copies' timeline: busy time as the union of the host-to-device copies, gaps of 50 us or more
    between them, and the GPU's kernel time inside each gap; other events (a device-to-host copy, host ops) count
    for nothing, and a profile without copies gives no line."""
    from sluice.benchmarks.profile import copy_timeline

    X = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [X("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", ts, dur) for ts, dur in ((0, 100), (80, 70), (180, 100), (1280, 120))]
    events += [X("kernel", "_grouped_gemm_kernel", 400, 600), X("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 300, 900),
               X("cpu_op", "aten::copy_", 150, 1000)]
    lines = copy_timeline(events).splitlines()
    # copies [0, 150] (two, overlapping), [180, 280], [1280, 1400]: busy 370 us of 1400; a 30-us gap is under the bound
    assert "busy 0.37 ms of 1.40 ms" in lines[0] and "(26%)" in lines[0]
    assert "1 gaps of 50 us or more: 1.00 ms" in lines[0] and "kernels running 0.60 ms" in lines[0]
    assert lines[1].split() == ["gap", "at", "0.28", "ms:", "1.000", "ms,", "kernels", "0.600", "ms", "of", "it"]
    assert copy_timeline([e for e in events if "HtoD" not in e["name"]]) == ""


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="a VRAM budget sizes the GPU slot bank")
def test_vram_budget_sizes_the_slot_bank(stores):
    """The slot bank gets what the budget leaves after the resident part and the reserve; a budget too small
    for one MoE layer's experts is refused, naming the sizes."""
    import torch

    from sluice.pipeline.budget import outside_allocator

    # what earlier tests in this process still hold, and the CUDA context (as the budget counts them)
    base = torch.cuda.memory_allocated() + outside_allocator(torch.cuda.current_device())
    reserve = 1 << 30
    try:
        with sluice.load(stores["qwen3_moe"], device=DEVICE, vram_budget=base + reserve + (64 << 20), vram_reserve=reserve) as engine:
            assert engine.store.manifest.top_k <= engine.rt.vram.capacity
            assert engine.rt.vram.capacity * engine.store.block_bytes <= 64 << 20
            assert engine.generate(PROMPT, 4)
        with pytest.raises(ConfigError, match="leaving room for"):
            sluice.load(stores["qwen3_moe"], device=DEVICE, vram_budget=base + reserve, vram_reserve=reserve)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the process cap the budget set, lifted for later tests


def test_vram_tier_policies_and_hot_set(stores, refs, tmp_path):
    """A frequency-kept VRAM tier and a hot set loaded from a routing trace change where blocks come from,
    never the result; the held blocks are the trace's most routed ones and serve as VRAM hits. (On a CPU the
    tier asked for by vram_slots is emulated in host memory.)"""
    from collections import Counter

    import yaml

    from sluice.pipeline.schedule import SCHEDULES_DIR
    from sluice.storage.trace import read_trace

    trace = tmp_path / "run.jsonl.gz"
    with sluice.load(stores["qwen3_moe"], device=DEVICE, record_routing=str(trace)) as engine:
        engine.generate(PROMPT, 8)
    ref = refs.greedy("qwen3_moe", PROMPT, 16)
    doc = yaml.safe_load((SCHEDULES_DIR / "vram-lfu.yaml").read_text())
    doc["stages"]["h2d"]["hot_set"] = str(trace)
    schedule = tmp_path / "hot.yaml"
    schedule.write_text(yaml.safe_dump(doc))
    for sched in ("vram-lfu", str(schedule)):
        with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=sched, vram_slots=24) as engine:
            assert engine.generate(PROMPT, 16) == ref
            held = [e.key for e in engine.rt.vram.entries() if e.pins > 0]
            vram_hits = engine.rt.stats.blocks["vram"]
        if sched != "vram-lfu":
            k = engine.store.manifest.top_k
            counts = Counter((r.layer, e) for r in read_trace(trace).records for e in r.experts)
            assert len(held) == min(24 - 2 * k, len(counts)) and vram_hits > 0
            assert min(counts[h] for h in held) >= sorted(counts.values(), reverse=True)[len(held) - 1]


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe"])
def test_long_prompts_run_in_chunks(variant, stores, refs):
    """A prompt longer than prefill_chunk runs as several steps: the logits of every position are those of the
    whole prompt in one step (within the golden tolerance: Mamba's chunked scan resumes from a state), and the
    greedy continuation is the reference's."""
    from common import assert_logits_close

    whole = refs.logits(variant, PROMPT)
    with sluice.load(stores[variant], device=DEVICE, prefill_chunk=5) as engine:
        assert engine.prefill_chunk == 5
        logits = engine.forward(PROMPT)
        assert logits.shape == whole.shape
        assert_logits_close(variant, logits, whole, f"{variant}: chunked prompt")
        last = engine.extend(engine.new_sequence(), PROMPT, last=True).cpu()  # the head on the last row only
        assert_logits_close(variant, last, whole[-1:], f"{variant}: chunked prompt, last row")
        assert engine.generate(PROMPT, 16) == refs.greedy(variant, PROMPT, 16)
        assert engine.rt.stats.steps >= 3 * (-(-len(PROMPT) // 5))  # forward, extend and generate, each in pieces


def test_mamba_prefill_runs_in_pieces_within_one_step(stores, refs, monkeypatch):
    """mixer_chunk: a prompt is one step (its experts read once) while each Mamba-2 mixer takes it in runs of
    mixer_chunk tokens, its state carried between them: logits within the golden tolerance, greedy tokens the
    reference's."""
    from sluice.models import nemotron_h
    from common import assert_logits_close

    runs = []
    call = nemotron_h._MixerLayer._call
    monkeypatch.setattr(nemotron_h._MixerLayer, "_call",
                        lambda self, h, *a: runs.append((self.block.block_type in nemotron_h.MAMBA, h.shape[1])) or call(self, h, *a))
    whole = refs.logits("nemotron_h", PROMPT)
    with sluice.load(stores["nemotron_h"], device=DEVICE, mixer_chunk=5) as engine:
        logits = engine.forward(PROMPT)
        assert engine.rt.stats.steps == 1
        assert_logits_close("nemotron_h", logits, whole, "mixer_chunk=5")
        assert engine.generate(PROMPT, 8) == refs.greedy("nemotron_h", PROMPT, 8)
    mamba = [n for is_mamba, n in runs if is_mamba]
    assert 5 in mamba and max(mamba) == 5  # 12 prompt tokens: runs of 5, 5, 2 in each Mamba layer; decode steps of 1
    assert max(n for is_mamba, n in runs if not is_mamba) == len(PROMPT)  # attention takes the piece whole


def test_prefill_chunk_follows_the_scratch_a_budget_leaves():
    """transformers' PyTorch Mamba-2 prefill of a Nemotron-3-Nano layer needs a [chunks, 128, 128, 64, 128] fp32
    temporary (2 GiB for 512 tokens). Twice a run's temporary must fit an eighth of the budget, or what the slots leave
    where every block fits: the full model at 8 GiB prefills 128 tokens a piece, at 24 GiB 256, at 32 GiB 512; a
    4-MoE-layer slice, whose blocks all fit with room to spare, 256 at 8 GiB; a piece asked for grows the reserve at the
    slots' expense; no Mamba layer, no limit. The reserve is the need (twice the scratch and the workspaces here),
    an eighth of the budget at least."""
    from sluice.models import get_architecture
    from sluice.pipeline.budget import WORKSPACE, plan_budget
    from sluice.storage.synth import _config

    GiB, block = 1 << 30, 5615616  # an NVFP4 Nano expert block
    _, nano = _config("nemotron-3-nano-30b-a3b", None)
    scratch = lambda n: get_architecture("nemotron_h").prefill_scratch_bytes(nano, n, broadcast=True)  # noqa: E731
    assert scratch(512) == 2 * GiB and scratch(100) == scratch(128) == GiB // 2
    # transformers' einsum scan (mamba2_chunk_scan, 5.2x): 48 MiB per 512 tokens, so 512-token runs even at 8 GiB
    einsum = lambda n: get_architecture("nemotron_h").prefill_scratch_bytes(nano, n, broadcast=False)  # noqa: E731
    assert einsum(512) == 48 << 20 and plan_budget(8 * GiB, 4_300_000_000, 2944, block, einsum)[1] == 512
    fused = lambda n: get_architecture("nemotron_h").prefill_scratch_bytes(nano, n, broadcast=False, fused=True)  # noqa: E731
    assert fused(2048) == 0 and plan_budget(8 * GiB, 4_300_000_000, 2944, block, fused, chunk=2048)[1:] == (2048, GiB)
    slots, chunk, reserve = plan_budget(8 * GiB, 4_300_000_000, 2944, block, scratch)
    assert (chunk, reserve) == (128, GiB + WORKSPACE) and slots == (8 * GiB - 4_300_000_000 - reserve) // block
    assert plan_budget(8 * GiB, int(1.81 * GiB), 512, block, scratch)[:2] == (512, 256)
    assert plan_budget(24 * GiB, 4_300_000_000, 2944, block, scratch)[1] == 256
    assert plan_budget(32 * GiB, 4_300_000_000, 2944, block, scratch)[1] == 512
    asked = plan_budget(8 * GiB, 4_300_000_000, 2944, block, scratch, chunk=512)
    assert asked[1:] == (512, 4 * GiB + WORKSPACE) and asked[0] < slots
    given = plan_budget(8 * GiB, 4_300_000_000, 2944, block, scratch, reserve=GiB)  # --vram-reserve: kept, the run fits it
    assert given[1:] == (16, GiB) and plan_budget(8 * GiB, 4_300_000_000, 2944, block, einsum, reserve=GiB)[1] == 512
    _, qwen = _config("qwen3-30b-a3b", None)
    none = lambda n: get_architecture("qwen3_moe").prefill_scratch_bytes(qwen, n)  # noqa: E731
    assert plan_budget(8 * GiB, 4_300_000_000, 6144, block, none)[1:] == (512, GiB)  # an eighth of the budget


def test_a_budget_keeps_room_for_the_states_of_a_batch():
    """A Nemotron-3-Nano sequence holds 53 MiB of state as a step first holds it (47 of Mamba-2 states, 6 of attention
    slots); a step's sequences' states join the reserve's need (32 sequences ran out of VRAM in a fixed 2 GiB reserve
    on an H100 where 16 ran), with a 2048-token prompt chunk's activations (an estimate: 0.33 GiB, where the measured
    peak was 0.55 GiB with the workspaces, one state and the staging bank), and the expert slots give way."""
    import torch

    from sluice.models import get_architecture
    from sluice.pipeline.budget import WORKSPACE, plan_budget, prompt_bytes, state_bytes
    from sluice.storage.synth import _config

    GiB, MiB, block = 1 << 30, 1 << 20, 5615616
    _, nano = _config("nemotron-3-nano-30b-a3b", None)
    arch = get_architecture("nemotron_h")
    one = state_bytes(arch, nano, torch.bfloat16, 4096)
    assert one == 53 * MiB + 80 * 1024 and state_bytes(arch, nano, torch.bfloat16, 256) < one
    prompt = prompt_bytes(nano, 6, 2048)
    assert 0.3 * GiB < prompt < 0.35 * GiB
    scratch = lambda n: arch.prefill_scratch_bytes(nano, n, broadcast=False)  # noqa: E731
    alone = plan_budget(8 * GiB, 4_300_000_000, 2944, block, scratch, states=one, prompt=prompt)
    assert alone[2] == GiB  # the need (0.75 GiB) under an eighth of the budget
    many = plan_budget(8 * GiB, 4_300_000_000, 2944, block, scratch, states=32 * one, prompt=prompt)
    assert many[2] == 2 * (48 * MiB) + prompt + 32 * one + WORKSPACE and many[0] < alone[0] and many[1] == 512


def test_attention_runs_without_cudnn_plans(stores, monkeypatch):
    """Every step runs SDPA with cuDNN off (it builds a plan per new key length: a new one every decode step),
    and the setting is the process's own again afterwards."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sluice.load(stores["qwen3_moe"], device=DEVICE) as engine:
        engine.generate(PROMPT, 3)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_profile_names_real_expert_kernels():
    """`bench model --profile` splits GPU time by these kernel names: each must be a kernel Sluice defines."""
    from sluice.kernels import decode, down, prefill
    from sluice.benchmarks.profile import EXPERT_KERNELS

    assert all(any(hasattr(m, n) for m in (decode, down, prefill)) for n in EXPERT_KERNELS)


def test_resident_roofline_adds_the_resident_part_to_the_pcie_time():
    """The performance issue's roofline: PCIe time of the bytes moved plus the resident part's own time, as GPU time
    (figures of a GPU run as the inputs: 0.99 + 2.58 ms against a 4.67 ms median) or measured alone (kept apart in the JSON)."""
    from sluice.benchmarks.model import resident_roofline

    d = {"roofline_ms_per_token": 0.99, "ms_per_token_median": 4.67}
    line = resident_roofline(d, 2.58)
    assert abs(d["pcie_plus_resident_gpu_ms_per_token"] - 3.57) < 1e-9 and d["resident_gpu_ms_per_token"] == 2.58
    assert "(GPU time)" in line and "= 3.57 ms/token" in line and "is 1.31 x" in line
    line = resident_roofline(d, 3.07, "alone")
    assert abs(d["pcie_plus_resident_alone_ms_per_token"] - 4.06) < 1e-9 and d["resident_gpu_ms_per_token"] == 2.58
    assert "(alone)" in line and "is 1.15 x" in line
    assert resident_roofline({"ms_per_token_median": 4.67}, None) == ""  # a CPU run: no PCIe roofline
    hybrid = {"roofline_ms_per_token": 5.90, "hybrid_roofline_ms_per_token": 4.19, "ms_per_token_median": 12.95}
    line = resident_roofline(hybrid, 3.50, "alone")  # the CPU's share (thirteenth set's Nano figures, a resident guess)
    assert abs(hybrid["hybrid_plus_resident_alone_ms_per_token"] - 7.69) < 1e-9 and "= 7.69 ms/token; decode median 1.68 x" in line
    cold = {"roofline_ms_per_token": 1.02, "disk_roofline_ms_per_token": 5.56, "ms_per_token_median": 8.88,
            "ms_per_token_mean": 20.46}  # the disk reads are the run's mean, so is the mean step compared
    line = resident_roofline(cold, 2.24, "alone")
    assert abs(cold["disk_plus_resident_alone_ms_per_token"] - 7.80) < 1e-9
    assert "= 7.80 ms/token; median step 1.14 x, mean step 2.62 x" in line
    assert "never" not in line  # no guess went unused
    # guesses that no step used, copied (PCIe) or read (disk), leave the stricter roofline: 7.80 - 0.3 - 1.5 = 6.00
    strict = {**cold, "unread_guesses_ms_per_token": 0.3, "unread_guess_reads_ms_per_token": 1.5}
    line = resident_roofline(strict, 2.24, "alone")
    assert "never read (0.30 ms): 2.96 ms/token, 3.00 x" in line
    assert "never used (1.80 ms): 6.00 ms/token; median step 1.48 x, mean step 3.41 x" in line
    assert abs(strict["used_disk_plus_resident_alone_ms_per_token"] - 6.0) < 1e-9


def test_predict_depth_guesses_later_layers_without_changing_logits(stores, tmp_path, monkeypatch):
    """`predict: {depth: 3}` also guesses the two MoE layers after the next one, from this layer's input (the right
    layers, nearest first); fetch reads them as guesses. Blocks read early change no logit."""
    import yaml

    from sluice.pipeline.schedule import SCHEDULES_DIR
    from sluice.stages.fetch import Fetch

    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    made = []
    real = Fetch._prefetch
    monkeypatch.setattr(Fetch, "_prefetch", lambda self, pred: (made.append(pred), real(self, pred))[1])
    runs = {}
    for depth in (1, 3):
        doc["stages"]["predict"] = {"depth": depth}
        path = tmp_path / f"depth{depth}.yaml"
        path.write_text(yaml.safe_dump(doc))
        made.clear()
        with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=str(path), ram_cache=24 * _block_bytes(stores)) as engine:
            layers = list(engine.store.moe_layers)
            seq = engine.new_sequence()
            logits = engine.extend(seq, PROMPT)
            steps = [engine.extend(seq, [int(logits[-1].argmax())])]
            for _ in range(6):
                steps.append(engine.extend(seq, [int(steps[-1][-1].argmax())]))
            runs[depth] = (torch.cat([logits] + steps), engine.rt.stats.snapshot()["prefetch_reads"])
        decode = [p for p in made if p.layer is not None]
        assert decode
        for p in decode:
            i = layers.index(p.layer)
            assert [p.layer, *(l for l, _ in p.further)] == layers[i : i + depth]
            assert all(len(g) == 4 for _, g in p.further)  # top-k guesses per layer
    assert torch.equal(runs[1][0], runs[3][0])
    assert runs[3][1] > runs[1][1]  # guesses for the layers further ahead were read
    doc["stages"]["predict"] = {"depth": 0}
    (tmp_path / "depth0.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SluiceError, match="'depth' must be >= 1"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=str(tmp_path / "depth0.yaml"))


def _block_bytes(stores) -> int:
    from sluice.storage.store import ExpertStore

    return ExpertStore.open(stores["qwen3_moe"]).block_bytes


def test_queued_guesses_are_promoted_or_cancelled_and_change_no_logit(stores, tmp_path, monkeypatch):
    """A slow drive with one reader: guesses (three layers ahead) are still queued when their layer runs, so fetch
    promotes the routed ones and cancels the rest (their slots freed); the logits are those of a run without guesses."""
    import time

    import yaml

    from sluice.pipeline.schedule import SCHEDULES_DIR
    from sluice.storage.reader import BlockReader

    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["fetch"] = {"prefetch": True, "readers": 1, "guess_reads": 1}
    doc["stages"]["predict"] = {"depth": 3}
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(doc))
    real = BlockReader._read_piece
    monkeypatch.setattr(BlockReader, "_read_piece", lambda self, *a: (time.sleep(0.003), real(self, *a))[1])
    calls = {"promote": 0, "cancel": 0}
    for name in calls:
        def spy(self, fut, _f=getattr(BlockReader, name), _n=name):
            done = _f(self, fut)
            calls[_n] += bool(done)
            return done
        monkeypatch.setattr(BlockReader, name, spy)
    runs = []
    for schedule in ("serial", str(tmp_path / "slow.yaml")):
        with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=schedule, ram_cache=20 * _block_bytes(stores)) as engine:
            seq = engine.new_sequence()
            out = [engine.extend(seq, PROMPT)]
            for _ in range(8):
                out.append(engine.extend(seq, [int(out[-1][-1].argmax())]))
            runs.append(torch.cat(out))
            assert all(e.pins == 0 for e in engine.rt.ram.entries() if not e.loading)  # a guess may still be read
    assert torch.equal(runs[0], runs[1])
    assert calls["promote"] > 0 and calls["cancel"] > 0


def test_guesses_are_skipped_while_their_recall_is_low(stores):
    """`min_recall` (fetch, h2d): guesses are read ahead only while the recent recall of the next layer's guesses
    reaches it; below it they are skipped (counted), prediction goes on, and the tokens are the same."""
    store = stores["nemotron_h_latent"]
    runs = {}
    for floor in (0.0, 0.999):
        with sluice.load(store, device=DEVICE, schedule=f"overlap:fetch.min_recall={floor}", ram_cache="64KiB") as engine:
            tokens = engine.generate(PROMPT, 12)
            s = engine.rt.stats.snapshot()
        runs[floor] = (tokens, s["prefetch_reads"], s["guesses_skipped"], s["predicted"])
    (t0, reads0, skipped0, predicted0), (t1, reads1, skipped1, predicted1) = runs[0.0], runs[0.999]
    assert t0 == t1 and predicted0 == predicted1 > 0
    assert skipped0 == 0 and skipped1 > 0 and reads1 < reads0
    copies = {}
    for floor in (0.0, 0.999):  # copies into VRAM ahead (h2d prefetch) are gated the same way
        with sluice.load(store, device=DEVICE, schedule=f"prefetch-vram:h2d.min_recall={floor}", vram_slots=8) as engine:
            tokens = engine.generate(PROMPT, 12)
            copies[floor] = (tokens, engine.rt.stats.snapshot()["vram_prefetches"])
    assert copies[0.0][0] == copies[0.999][0] and copies[0.999][1] < copies[0.0][1]
    with pytest.raises(ScheduleError, match="'min_recall' must be between 0 and 1"):
        sluice.load(store, device=DEVICE, schedule="overlap:fetch.min_recall=1.5")
