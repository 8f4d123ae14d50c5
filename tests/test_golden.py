"""Golden tests: Sluice against transformers' own model on the same checkpoint (fp32, CPU, eager experts).

Every one compares the logits of the prompt and of each decode step (teacher-forced on the reference's greedy
tokens: tests/common.py teacher_forced), and the greedy tokens exactly. Tolerance: tests/common.py LOGIT_ATOL, per
model, set from the error measured (~1e-7 to 2e-6: both sides run the same fp32 modules and differ in the order
routed outputs are summed and in BLAS blocking) and tight enough that a routed sum 0.1% off in decode fails;
tests/mutants.py injects such bugs into a copy of the package and checks that these tests fail.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch

import sluice
from sluice.models.base import cache_kw
from sluice.errors import CorruptBlockError
from sluice.pipeline.schedule import SCHEDULES_DIR
from sluice.stages.compute import GIL_SWITCH_S
from common import DEVICE, MUST_DIFFER, PROMPT, VARIANTS, assert_logits_close, teacher_forced
# every bundled schedule but those that differ from one of these only in a tier a CPU run lacks (the VRAM
# tier's policy) or in a path tested on its own (the hybrid CPU path below, test_hybrid_cpu_path_*; `direct`, which
# holds every block in RAM: tests/test_direct.py; direct-hybrid, its share on the CPU: tests/test_table_cpu.py), and
# resident-alone, which skips the routed experts on purpose (a measurement, tested against transformers without them in
# tests/test_direct.py)
SKIPPED = ("vram-lfu", "hybrid", "hybrid-vram", "direct", "direct-hybrid", "resident-alone")
SCHEDULES = tuple(sorted(p.stem for p in SCHEDULES_DIR.glob("*.yaml") if p.stem not in SKIPPED))


def check_golden(engine, variant: str, refs, where: str, n: int = 32, ref: str | None = None) -> None:
    """engine's logits of PROMPT and of n - 1 decode steps after it (teacher-forced) within `variant`'s tolerance of
    the reference's (refs' model `ref`, default the variant's), and its argmax the reference's greedy tokens."""
    ref = ref or variant
    ref_tokens, ref_steps = refs.decode(ref, PROMPT, n)
    prompt, steps = teacher_forced(engine, PROMPT, ref_tokens)
    assert_logits_close(variant, prompt, refs.logits(ref, PROMPT), f"{where}: prompt")
    assert_logits_close(variant, steps, ref_steps, f"{where}: decode steps")
    assert mean_kl(ref_steps, steps) < 1e-8, f"{where}: decode KL"
    assert steps.argmax(-1).tolist() == ref_tokens, f"{where}: greedy tokens differ"


def mean_kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p = torch.log_softmax(ref.double(), -1)
    q = torch.log_softmax(got.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def least_blocks(store, schedule: str) -> int:
    """The smallest RAM cache a schedule accepts, in blocks: one layer's experts for direct-stream, else one."""
    from sluice.storage.store import ExpertStore

    return ExpertStore.open(store).manifest.num_experts if schedule == "direct-stream" else 1


def ram_sizes(store, least: int = 1) -> list[int]:
    """RAM caches from the smallest the engine accepts (`least` blocks: one, or one layer's experts for
    direct-stream) to every block of the store."""
    from sluice.storage.store import ExpertStore

    s = ExpertStore.open(store)
    return [least * s.block_bytes, (least + 2) * s.block_bytes, s.total_blocks * s.block_bytes]


# CI's suite runs every variant through the default schedule and every other schedule through three or four
# variants (each schedule's decode path differs; their prompts are bit-identical, test_bit_identical_*); the rest
# of the product is marked slow (`make test-all`)
CORE = {"serial": ("nemotron_h", "qwen3_moe", "gpt_oss"),
        "prefetch-vram": ("nemotron_h_latent", "deepseek_v3", "qwen3_5_moe"),
        "zero-skip": ("nemotron_h", "nemotron_h_latent", "nemotron_h_groups"),
        "direct-stream": ("nemotron_h_latent", "qwen3_moe", "deepseek_v4", "gpt_oss_unquantized")}


def golden_cases():
    # a schedule added later must be placed in CORE (or run by every variant, as overlap) to run in CI's suite
    assert set(CORE) | {"overlap"} == set(SCHEDULES), (sorted(CORE), SCHEDULES)
    assert all(v in VARIANTS for vs in CORE.values() for v in vs), CORE
    for v in VARIANTS:
        for s in SCHEDULES:
            core = s == "overlap" or v in CORE.get(s, ())
            yield pytest.param(v, s, marks=() if core else pytest.mark.slow, id=f"{v}-{s}")


@pytest.mark.parametrize("variant, schedule", list(golden_cases()))
def test_matches_transformers(variant, schedule, stores, refs):
    ref_tokens = refs.greedy(variant, PROMPT, 32)
    # the smallest VRAM bank and the default; on a CPU, where a tier is only there when asked for (emulated in
    # host memory), the smallest for the schedules whose copies it changes
    if DEVICE.startswith("cuda"):
        vram_slots = (1, None)
    else:
        vram_slots = (None, 1) if schedule in ("overlap", "prefetch-vram") else (None,)
    for ram in ram_sizes(stores[variant], least_blocks(stores[variant], schedule)):
        for vram in vram_slots:
            where = f"{variant}/{schedule}/ram={ram}/vram={vram}"
            with sluice.load(stores[variant], device=DEVICE, schedule=schedule, ram_cache=ram, vram_slots=vram) as engine:
                check_golden(engine, variant, refs, where)
                # again through generate (the head on the last row only), its caches warm from the first pass
                assert engine.generate(PROMPT, 32) == ref_tokens, f"{where}: greedy tokens differ (generate)"


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe", "deepseek_v3"])
def test_vram_prefetch_copies_guesses_ahead(variant, stores, refs):
    """prefetch-vram: the next layer's guessed experts are copied into VRAM after a layer's own copies; the next
    layer then finds them there (hits counted), and logits and greedy tokens stay the reference's. On a CPU the
    VRAM tier is emulated in host memory (the same tier code; copies are memcpy)."""
    runs = {}
    for schedule in ("overlap", "prefetch-vram"):
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule, vram_slots=12) as engine:
            check_golden(engine, variant, refs, f"{variant}/{schedule}")
            runs[schedule] = engine.rt.stats.counters()
    off, on = runs["overlap"], runs["prefetch-vram"]
    assert off["vram_prefetches"] == off["vram_prefetch_hits"] == 0
    assert 0 < on["vram_prefetch_hits"] <= on["vram_prefetches"]
    assert on["blocks"]["vram"] > off["blocks"]["vram"]  # guesses that came true were VRAM hits, not copies


def triton_schedule(tmp_path, base: str, **compute) -> str:
    """A copy of a bundled schedule with the compute stage's knobs changed (a YAML edit, as a user would)."""
    import yaml

    doc = yaml.safe_load((SCHEDULES_DIR / f"{base}.yaml").read_text())
    doc["stages"]["compute"] = {**(doc["stages"]["compute"] or {}), **compute}
    path = tmp_path / f"{base}-triton.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# interpreted Triton is slow: variants whose expert path another variant already takes are left out
# (gpt_oss_unquantized: dense + bias kernels, tested in test_kernels; qwen3_5_moe_text: qwen3_5_moe's LM)
SAME_KERNELS = {"gpt_oss_unquantized", "qwen3_5_moe_text"}
TRITON_CASES = [(v, "zero-skip" if arch == "nemotron_h" else "overlap") for v, (arch, _) in VARIANTS.items() if v not in SAME_KERNELS]
TRITON_CASES += [("nemotron_h_latent", "overlap")]


# in CI's suite: a ReLU^2 latent model with zero-skip and a SwiGLU one; the others (gpt-oss's MXFP4 GLU and
# DeepSeek-V4's clamped SwiGLU among them, each slow interpreted) are marked slow
TRITON_CORE = {("nemotron_h_latent", "zero-skip"), ("qwen3_moe", "overlap")}


@pytest.mark.parametrize("variant, base", [pytest.param(*c, marks=() if c in TRITON_CORE else pytest.mark.slow) for c in TRITON_CASES])
def test_triton_kernels_match_transformers(variant, base, stores, refs, tmp_path):
    """The same golden check through the Triton expert kernels (interpreted on a CPU: fewer decode steps there, each
    through the same kernels)."""
    n = 32 if DEVICE != "cpu" else 12
    schedule = triton_schedule(tmp_path, base, backend="triton")
    with sluice.load(stores[variant], device=DEVICE, schedule=schedule, ram_cache=ram_sizes(stores[variant])[1]) as engine:
        check_golden(engine, variant, refs, f"{variant}/{base}/triton", n=n)
        s = engine.rt.stats.snapshot()
    if base == "zero-skip" and VARIANTS[variant][0] == "nemotron_h":
        # counted per decode step; random weights leave almost no all-zero group (skipping itself: test_kernels)
        assert 0 < s["live_groups"] <= s["total_groups"] == (n - 1) * 3 * 4 * (32 // 16)  # n - 1 decode steps


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU (run with SLUICE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("variant, base", [("nemotron_h_latent", "zero-skip"), ("qwen3_moe", "overlap"), ("gpt_oss", "overlap")])
def test_cuda_graphs_change_nothing(variant, base, stores, tmp_path):
    """Decode steps replayed as CUDA graphs give the eager kernels' logits bit for bit, and count live groups alike."""
    runs = []
    for graphs in (False, True):
        schedule = triton_schedule(tmp_path, base, backend="triton", graphs=graphs)
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule) as engine:
            seq = engine.new_sequence()
            logits = [engine.extend(seq, PROMPT)[-1]]
            for _ in range(6):
                logits.append(engine.extend(seq, [int(logits[-1].argmax())])[-1])
            runs.append((torch.stack(logits).cpu(), engine.rt.stats.snapshot()["live_groups"]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU (run with SLUICE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("variant, schedule", [("nemotron_h", "overlap"), ("nemotron_h_latent", "zero-skip"), ("nemotron_h_groups", "serial")])
def test_resident_graphs_change_nothing(variant, schedule, stores):
    """Mamba layers' one-token steps and the MoE layers' pure functions (MoE input, routers, latent
    projections, shared expert) replayed as CUDA graphs give the eager logits bit for bit, also across a
    second sequence and a restored snapshot (new state tensors: captured anew where their addresses
    changed, replayed where the allocator gave the same ones back)."""
    runs = []
    for graphs in (False, True):
        with sluice.load(stores[variant], device=DEVICE, resident_graphs=graphs, schedule=schedule) as engine:
            logits = []
            for _ in range(2):
                seq = engine.new_sequence()
                logits.append(engine.extend(seq, PROMPT)[-1])
                for _ in range(5):
                    logits.append(engine.extend(seq, [int(logits[-1].argmax())])[-1])
            seq = engine.restore(engine.snapshot(seq))
            for _ in range(3):
                logits.append(engine.extend(seq, [int(logits[-1].argmax())])[-1])
            runs.append(torch.stack(logits).cpu())
            if graphs:
                assert engine.graphs.replays > 0 and engine.graphs.captures >= 2 and engine.fn_graphs.replays > 0
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bit_identical_across_runs_schedules_and_caches(variant, stores):
    outputs = []
    for schedule in SCHEDULES:
        for ram in ram_sizes(stores[variant], least_blocks(stores[variant], schedule))[::2]:
            with sluice.load(stores[variant], device=DEVICE, schedule=schedule, ram_cache=ram) as engine:
                outputs.append(engine.forward(PROMPT))
                outputs.append(engine.forward(PROMPT))  # warm cache, same engine
    for o in outputs[1:]:
        assert torch.equal(o, outputs[0])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_experts_decide_the_output(variant, checkpoints, refs):
    """Zeroing every routed expert must change most greedy tokens, else the golden test could not fail."""
    model = refs.load(variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.zero_()
        ids, out = [], model(torch.tensor([PROMPT]), use_cache=True)
        for _ in range(32):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[ids[-1]]]), use_cache=True, **cache_kw(out.past_key_values))
    same = sum(a == b for a, b in zip(ids, refs.greedy(variant, PROMPT, 32)))
    assert same <= 8, f"only {32 - same}/32 tokens changed without experts"


def _swap_blocks(store, dst, layer: int, a: int, b: int) -> None:
    """Copy a store, swapping two experts' blocks and their checksums (so only the golden check can see it)."""
    shutil.copytree(store, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    entry = next(l for l in manifest["layers"] if l["layer"] == layer)
    n = manifest["block_bytes"]
    path = dst / entry["file"]
    data = bytearray(path.read_bytes())
    data[a * n : (a + 1) * n], data[b * n : (b + 1) * n] = data[b * n : (b + 1) * n], data[a * n : (a + 1) * n]
    path.write_bytes(data)
    sums = entry["checksums"]
    sums[a], sums[b] = sums[b], sums[a]
    (dst / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_swapped_experts_diverge(variant, stores, refs, tmp_path):
    """A wrong expert permutation passes checksums but must fail the golden comparison."""
    with sluice.load(stores[variant], device=DEVICE) as engine:
        layer = engine.model.moe_blocks[0].layer
        engine.forward(PROMPT)  # fills the RAM cache with the experts the prompt uses
        routed = engine.rt.ram.entries()
    experts = sorted({e.key[1] for e in routed if e.key[0] == layer})
    bad = tmp_path / "swapped"
    _swap_blocks(stores[variant], bad, layer, experts[0], experts[1])
    with sluice.load(bad, device=DEVICE) as engine:
        diff = (engine.forward(PROMPT) - refs.logits(variant, PROMPT)).abs().max().item()
    assert diff > MUST_DIFFER


def test_gpt_oss_gate_up_interleave_must_be_undone(checkpoints, refs, tmp_path, monkeypatch):
    """gpt-oss interleaves gate (even rows) and up (odd rows): reading them the other way round makes a
    valid store that must fail the golden comparison."""
    import sluice.models.gpt_oss as gpt_oss
    from sluice.storage.repack import repack

    right = gpt_oss.split_fused

    def swapped(name, info):
        parts = right(name, info)
        swap = {"gate": "up", "up": "gate"}
        return None if parts is None else [(l, e, swap.get(p, p), sfx, part) for l, e, p, sfx, part in parts]

    monkeypatch.setattr(gpt_oss, "split_fused", swapped)
    bad = repack(checkpoints["gpt_oss"], tmp_path / "swapped", progress=False)
    with sluice.load(bad.path, device=DEVICE) as engine:
        diff = (engine.forward(PROMPT) - refs.logits("gpt_oss", PROMPT)).abs().max().item()
    assert diff > MUST_DIFFER


@pytest.mark.parametrize("schedule", ["overlap", "direct-stream"])
def test_corrupt_block_is_named(schedule, stores, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(stores["nemotron_h"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    layer = manifest["layers"][0]
    n = manifest["block_bytes"]
    path = bad / layer["file"]
    data = bytearray(path.read_bytes())
    for expert in range(manifest["num_experts"]):  # every block of the first MoE layer
        data[expert * n + 100] ^= 0xFF
    path.write_bytes(data)
    with sluice.load(bad, device=DEVICE, schedule=schedule) as engine:
        with pytest.raises(CorruptBlockError, match=rf"layer {layer['layer']}, expert \d+"):
            engine.forward(PROMPT)
        # the engine recovers: a fresh sequence on a store-independent path still reports the same error
        with pytest.raises(CorruptBlockError):
            engine.forward(PROMPT)
    with sluice.load(bad, device=DEVICE, schedule=schedule, verify_checksums=False) as engine:
        assert engine.forward(PROMPT).shape[0] == len(PROMPT)  # unverified reads run (wrongly) instead


def test_deepseek_v4_reads_deepseek_names(checkpoints, refs, tmp_path):
    """DeepSeek's own tensor names (embed.weight, layers.L.attn.wq_a.weight, hc_head_fn, ...: no model. prefix)
    run as the names save_pretrained writes do."""
    from safetensors.torch import load_file, save_file

    def deepseek_name(name: str) -> str:
        for pattern, repl in ((r"^model\.embed_tokens\.", "embed."), (r"^model\.hc_head\.hc_", "hc_head_"), (r"^model\.", "")):
            name = re.sub(pattern, repl, name)
        return name

    d = tmp_path / "deepseek-names"
    shutil.copytree(checkpoints["deepseek_v4"], d)
    tensors = load_file(d / "model.safetensors")
    save_file({deepseek_name(k): v for k, v in tensors.items()}, d / "model.safetensors", metadata={"format": "pt"})
    with sluice.load(d, device=DEVICE, progress=False) as engine:
        assert_logits_close("deepseek_v4", engine.forward(PROMPT), refs.logits("deepseek_v4", PROMPT), "deepseek names")


def test_qwen3_5_fused_experts_as_released(checkpoints, refs, tmp_path):
    """Qwen3.5's BF16 releases fuse a layer's experts: gate_up_proj [E, 2I, D] (gate rows first), down_proj
    [E, D, I]. transformers reads that checkpoint as the per-expert one; so must repack, and reading the
    halves the other way round must fail."""
    import sluice.models.qwen3_5_moe as q35
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from sluice.storage.repack import repack

    d = tmp_path / "fused"
    shutil.copytree(checkpoints["qwen3_5_moe"], d)
    tensors = load_file(d / "model.safetensors")
    per = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
    found: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in tensors if per.match(n)]:
        m = per.match(name)
        found.setdefault(m["layer"], {}).setdefault(m["proj"], {})[int(m["e"])] = tensors.pop(name)
    assert found, "the tiny checkpoint stores experts one by one"
    for layer, projs in found.items():
        stack = {p: torch.stack([w[e] for e in sorted(w)]) for p, w in projs.items()}
        tensors[f"{layer}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        tensors[f"{layer}.down_proj"] = stack["down"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    ref = refs.logits("qwen3_5_moe", PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        assert_logits_close("qwen3_5_moe", hf(torch.tensor([PROMPT])).logits[0], ref, "transformers, fused")  # transformers agrees

    with sluice.load(d, device=DEVICE, progress=False) as engine:
        assert_logits_close("qwen3_5_moe", engine.forward(PROMPT), ref, "fused")

    right = q35.split_fused

    def swapped(name, info):
        parts = right(name, info)
        swap = {"gate": "up", "up": "gate"}
        return None if parts is None else [(l, e, swap.get(p, p), sfx, part) for l, e, p, sfx, part in parts]

    q35.split_fused = swapped
    try:
        bad = repack(d, tmp_path / "swapped", progress=False)
    finally:
        q35.split_fused = right
    with sluice.load(bad.path, device=DEVICE) as engine:
        assert (engine.forward(PROMPT) - ref).abs().max().item() > MUST_DIFFER


@pytest.mark.parametrize("variant", ["nemotron_h_latent", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_hybrid_cpu_path_matches_transformers(variant, share, stores, refs, tmp_path):
    """The hybrid miss path: a share of each one-token layer's blocks computed by the CPU kernels straight
    from their RAM slots (kernels/cpu.py, eager here), the rest as usual: the logits of the prompt and of every
    step, and the greedy tokens, as transformers'."""
    import yaml

    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["h2d"] = {**(doc["stages"]["h2d"] or {}), "cpu_share": share}
    doc["stages"]["compute"] = {**(doc["stages"]["compute"] or {}), "cpu_compile": False}
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump(doc))
    switch = sys.getswitchinterval()
    with sluice.load(stores[variant], device=DEVICE, schedule=str(path)) as engine:
        check_golden(engine, variant, refs, f"{variant}/hybrid share={share}", n=16)  # one-token steps: the hybrid path
        assert engine.rt.cpu_rate.block_s is not None  # the CPU path ran
        assert sys.getswitchinterval() <= GIL_SWITCH_S  # the worker's GIL hand-offs made short
    assert sys.getswitchinterval() == switch  # and Python's own put back


def test_gil_switch_interval_is_shared_by_every_engines_workers():
    """Two engines' CPU workers in one process: the interval stays short until the last one stops, then
    Python's own comes back (not the first engine's view of it)."""
    from sluice.stages.compute import _short_gil_switch

    own = sys.getswitchinterval()
    _short_gil_switch(+1)
    _short_gil_switch(+1)
    _short_gil_switch(-1)
    assert sys.getswitchinterval() <= GIL_SWITCH_S
    _short_gil_switch(-1)
    assert sys.getswitchinterval() == own


def test_balance_sends_a_block_to_the_cpu_only_where_both_finish_sooner():
    """h2d's split of a layer's misses between the CPU and the copies: the count that finishes both
    soonest, none when one CPU block outlasts all the copies, equal to a brute-force search."""
    import itertools

    from sluice.stages.h2d import balance_cpu_blocks

    assert balance_cpu_blocks(3, 0.1, 0.7) == 0  # a CPU block (0.7) ends after the other copies (0.2)
    assert balance_cpu_blocks(20, 0.1, 0.3) == 5  # 5 x 0.3 = 15 x 0.1
    assert balance_cpu_blocks(10, 0.1, 0.1) == 5
    assert balance_cpu_blocks(1, 0.1, 0.05) == 1 and balance_cpu_blocks(0, 0.1, 0.05) == 0
    for n, tg, tc in itertools.product(range(0, 25), (0.05, 0.1, 0.3), (0.01, 0.1, 0.25, 0.7, 3.0)):
        best = min(range(n + 1), key=lambda c: (round(max(c * tc, (n - c) * tg), 9), c))  # ties: fewer
        assert balance_cpu_blocks(n, tg, tc) == best, (n, tg, tc)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="cpu_balance follows the host-to-device rate: CUDA only")
def test_balanced_hybrid_path_follows_the_cpu_rate(stores, refs, tmp_path):
    """With cpu_balance the CPU takes none of a layer's misses when it is far slower than the copies
    (bar the rare probe that keeps its rate measured), and all of them when it is far faster; tokens as
    transformers' either way."""
    import yaml

    variant = "nemotron_h_latent"
    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["h2d"] = {**(doc["stages"]["h2d"] or {}), "cpu_share": 1.0, "cpu_balance": True}
    doc["stages"]["compute"] = {**(doc["stages"]["compute"] or {}), "cpu_compile": False}
    path = tmp_path / "balanced.yaml"
    path.write_text(yaml.safe_dump(doc))
    ref_tokens = refs.greedy(variant, PROMPT, 13)
    with sluice.load(stores[variant], device=DEVICE, schedule=str(path), vram_slots=4) as engine:
        seq = engine.new_sequence()
        tokens = [int(engine.extend(seq, PROMPT)[-1].argmax())]
        for _ in range(2):  # cpu_share 1 until the CPU has a rate (its first block compiles: not a rate)
            tokens.append(int(engine.extend(seq, tokens[-1:])[-1].argmax()))
        assert engine.rt.cpu_rate.block_s is not None
        counts = []
        for rate in (1e3, 1e-9):  # seconds per block: far slower than a copy, then far faster
            before = engine.rt.stats.cpu_blocks
            for _ in range(5):
                engine.rt.cpu_rate.set(rate)  # keep the forced rate over the measured one
                tokens.append(int(engine.extend(seq, tokens[-1:])[-1].argmax()))
            counts.append(engine.rt.stats.cpu_blocks - before)
    assert tokens == ref_tokens
    slow, fast = counts
    assert slow <= 1 and fast >= 2, counts  # fast: the first layer with misses in each step sends them all


@pytest.mark.parametrize("variant", ["nemotron_h_latent", "qwen3_moe"])
def test_hybrid_prefill_matches_transformers(variant, stores, refs, tmp_path):
    """Prompt steps on the hybrid path: experts routed few of the prompt's tokens (here at most 2) are
    computed on the CPU from RAM, token by token; the prompt's logits are transformers'."""
    import yaml

    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["h2d"] = {**(doc["stages"]["h2d"] or {}), "cpu_prefill": 2}
    doc["stages"]["compute"] = {**(doc["stages"]["compute"] or {}), "cpu_compile": False}
    path = tmp_path / "hybrid-prefill.yaml"
    path.write_text(yaml.safe_dump(doc))
    with sluice.load(stores[variant], device=DEVICE, schedule=str(path)) as engine:
        logits = engine.forward(PROMPT)
        assert engine.rt.stats.cpu_blocks > 0
    assert_logits_close(variant, logits, refs.logits(variant, PROMPT), f"{variant}/hybrid prompt")


@pytest.mark.timeout(120)
def test_hybrid_path_through_a_small_ram_cache(stores, refs, tmp_path):
    """With fewer RAM slots than a layer's experts, blocks pass through the cache in turns: the CPU path must
    give its slots back as soon as it is done with them (it once held them to the end of the layer, and fetch
    waited for a slot forever)."""
    import yaml

    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["h2d"] = {**(doc["stages"]["h2d"] or {}), "cpu_share": 1}
    doc["stages"]["compute"] = {**(doc["stages"]["compute"] or {}), "cpu_compile": False}
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump(doc))
    from sluice.storage.store import ExpertStore

    store = stores["qwen3_moe"]
    with sluice.load(store, device=DEVICE, schedule=str(path), ram_cache=3 * ExpertStore.open(store).block_bytes) as engine:
        assert engine.generate(PROMPT, 8) == refs.greedy("qwen3_moe", PROMPT, 8)
        assert engine.rt.stats.cpu_blocks > 0


def test_nemotron_h_omni_language_model(tmp_path):
    """A NemotronH vision-language checkpoint (transformers' nemotron_h_omni, its own saved names:
    language_model.backbone.*, vision_model.radio_model.*) runs its language model through the spine:
    text logits and greedy tokens equal transformers' whole omni model's on a text prompt."""
    pytest.importorskip("transformers.models.nemotron_h_omni", reason="nemotron_h_omni needs transformers 5.23+")
    from transformers import AutoModelForImageTextToText

    from tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "omni", "nemotron_h_omni", seed=11)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    ids = list(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        for _ in range(12):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    with sluice.load(path, device=DEVICE, progress=False) as engine:
        logits = engine.forward(PROMPT)
        tokens = engine.generate(PROMPT, 12)
        names = {s.name for s in engine.store.manifest.slots}
        from safetensors import safe_open

        with safe_open(str(engine.store.path / engine.store.manifest.resident), "pt") as f:
            resident = set(f.keys())
    assert names == {"up.weight", "down.weight"}
    assert resident and all(k.startswith("language_model.backbone.") or k.startswith("language_model.lm_head") for k in resident)
    assert_logits_close("nemotron_h_omni", logits, ref, "omni")
    assert tokens == ids[len(PROMPT):]



STATIC = [v for v in VARIANTS if not v.startswith("deepseek_v4")]  # its compressed attention has no static layer


@pytest.mark.parametrize("variant", STATIC)
def test_static_kv_cache_matches_transformers(variant, stores, refs):
    """`static_kv`: attention over a preallocated cache (fixed tensors, what a CUDA graph of a one-token attention
    step needs) gives transformers' logits at every decode step, as the growing cache does."""
    with sluice.load(stores[variant], device=DEVICE, static_kv=len(PROMPT) + 40) as engine:
        check_golden(engine, variant, refs, f"{variant} static_kv")


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe", "gpt_oss"])
def test_static_kv_windows_match_transformers(variant, stores, refs, monkeypatch):
    """A static cache read through windows (models/static_cache.py) that the sequence outgrows during decode (16 slots,
    then 32, then 64 of 200): transformers' logits at every step; with the windows' growth switched off (attention
    over 16 slots only) the check fails as it must."""
    from sluice.models import static_cache

    monkeypatch.setattr(static_cache, "MIN_WINDOW", 16)
    with sluice.load(stores[variant], device=DEVICE, static_kv=200) as engine:
        seq = engine.new_sequence()
        engine.extend(seq, PROMPT)
        assert {layer.window for layer in seq.cache.layers if hasattr(layer, "window")} == {16}
        check_golden(engine, variant, refs, f"{variant} static_kv windows")
    monkeypatch.setattr(static_cache, "fit", lambda cache, tokens: 16)
    with sluice.load(stores[variant], device=DEVICE, static_kv=200) as engine:
        with pytest.raises(AssertionError):
            check_golden(engine, variant, refs, f"{variant} static_kv, a window left at 16")


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe"])
def test_static_kv_slots_grow_as_the_sequence_needs(variant, stores, refs, monkeypatch):
    """A static cache's slots start few (FIRST_SLOTS, here 16) and double as the sequence outgrows them (16 -> 32 -> 64
    of 200, what they held copied over): transformers' logits at every step; slots that grow without their contents
    fail the check as they must."""
    from sluice.models import static_cache

    monkeypatch.setattr(static_cache, "MIN_WINDOW", 16)
    monkeypatch.setattr(static_cache, "FIRST_SLOTS", 16)
    with sluice.load(stores[variant], device=DEVICE, static_kv=200) as engine:
        seq = engine.new_sequence()
        engine.extend(seq, PROMPT)
        slots = lambda: {layer.max_cache_len for layer in seq.cache.layers if hasattr(layer, "window")}  # noqa: E731
        assert slots() == {16}
        engine.extend(seq, list(range(3, 3 + 30)))
        assert slots() == {64} and {layer.keys.shape[2] for layer in seq.cache.layers if hasattr(layer, "window")} == {64}
        check_golden(engine, variant, refs, f"{variant} static_kv growing")
    grow = static_cache._grow

    def forgetful(layer, slots):  # new tensors of the right size, what the old ones held dropped
        grow(layer, slots)
        for name in ("keys", "values"):
            if isinstance(getattr(layer, name, None), torch.Tensor):
                getattr(layer, name).zero_()

    monkeypatch.setattr(static_cache, "_grow", forgetful)
    with sluice.load(stores[variant], device=DEVICE, static_kv=200) as engine:
        with pytest.raises(AssertionError):
            check_golden(engine, variant, refs, f"{variant} static_kv, slots grown empty")


def test_static_kv_bounds_and_refusals(stores):
    """A sequence may not grow past the static cache (a one-line error naming the setting); a model whose layers
    transformers' StaticCache cannot hold is refused by name; the setting is a count of tokens, 0 the growing cache."""
    from sluice.errors import ConfigError, SluiceError

    with sluice.load(stores["qwen3_moe"], device=DEVICE, static_kv=len(PROMPT) + 2) as engine:
        seq = engine.new_sequence()
        engine.extend(seq, PROMPT)
        engine.extend(seq, [5, 6])
        with pytest.raises(SluiceError, match=r"more than the static_kv cache's \d+ \(--static-kv\)"):
            engine.extend(seq, [7])
        with pytest.raises(SluiceError, match=r"up to 4 new ones need more than the static_kv cache's"):  # before any step
            engine.generate(PROMPT, 4)
    with pytest.raises(ConfigError, match="static_kv: transformers' StaticCache cannot hold"):
        with sluice.load(stores["deepseek_v4"], device=DEVICE, static_kv=64) as engine:
            engine.new_sequence()
    with pytest.raises(ConfigError, match=r"static_kv: must be a count of tokens \(0: off\), got -1"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, static_kv=-1)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, static_kv=0) as engine:
        assert engine.config.static_kv is None and type(engine.new_sequence().cache).__name__ == "DynamicCache"
