"""Quantised checkpoints end to end: the store keeps their bytes, Sluice matches transformers run on
the independently dequantised weights (modelopt's NVFP4 code; on a GPU machine without modelopt, our reference
decode: tests/quant.py), greedy tokens and logits alike.

Reported per case (in the assertion messages and `-rA` output): top-1 agreement over the prompt's
positions plus 32 greedy tokens, and the mean KL divergence of the prompt's next-token distributions.
"""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.kernels.linear import QuantLinear
from sluice.storage.repack import repack
from sluice.storage.store import ExpertStore
from common import DEVICE, PROMPT, assert_logits_close, teacher_forced
from quant import quantize, quantize_checkpoint
from test_golden import mean_kl, triton_schedule

CASES = {  # name -> (tiny variant, experts' format, resident linears quantised too: False, True (same format) or a format)
    "nemotron_nvfp4_all": ("nemotron_h_latent", "nvfp4", True),
    "nemotron_fp8": ("nemotron_h", "fp8", False),
    "nemotron_fp8_row": ("nemotron_h_groups", "fp8_row", False),
    "qwen_nvfp4_ct": ("qwen3_moe", "nvfp4_ct", False),
    "qwen_fp8_block_all": ("qwen3_moe", "fp8_block", True),
    # as DeepSeek-V4-Flash ships: FP4 experts (I8 + E8M0 `scale`), FP8 linears with E8M0 block `scale`s,
    # the grouped output projection among them (its groups as wide as an FP8 block)
    "deepseek_v4_release": ("deepseek_v4_wide", "mxfp4_ds", "fp8_block_e8m0"),
}
# The indexer keeps every compressed entry here: with coarse FP8 weights two entries can score the same,
# and a top-k between equal scores is decided by rounding (on CUDA the greedy tokens parted from the
# reference that way while every logit stayed within 2e-6). CSA's selection is tested unquantised.
EXTRA_VARIANTS = {"deepseek_v4_wide": ("deepseek_v4", {"o_lora_rank": 32, "index_topk": 64})}


class _Quantized(dict):
    """case -> (store, reference checkpoint), made on first use (NVFP4 cases need modelopt, except on a GPU run: tests/quant.py)."""

    def __init__(self, checkpoints, root):
        super().__init__()
        self.checkpoints, self.root = checkpoints, root

    def __missing__(self, name):
        from tiny import make_tiny_checkpoint

        variant, fmt, resident = CASES[name]
        if variant in EXTRA_VARIANTS:
            arch, over = EXTRA_VARIANTS[variant]
            src = make_tiny_checkpoint(self.root / variant, arch, seed=7, **over)
        else:
            src = self.checkpoints[variant]
        dst, ref = quantize_checkpoint(src, self.root / name, self.root / f"{name}-ref", fmt, resident)
        self[name] = (repack(dst, self.root / f"{name}-store", progress=False).path, ref)
        return self[name]


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    return _Quantized(checkpoints, tmp_path_factory.mktemp("quant"))


def _reference(ref_path, n):
    from conftest import References

    r = References({"m": ref_path})
    return r.logits("m", PROMPT), *r.decode("m", PROMPT, n)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_golden(case, backend, quantized, tmp_path):
    store, ref_path = quantized[case]
    # interpreted Triton is slow: fewer tokens on a CPU (6: DeepSeek-V4's compressors each complete a block in decode)
    n = 32 if backend == "torch" or DEVICE != "cpu" else 6
    ref_logits, ref_tokens, ref_steps = _reference(ref_path, n)
    # fp32 products (`fp4_matvec: words`): on sm_89+ the default for ReLU^2 experts is f16x2, whose fp16 products can
    # flip a near tie (nemotron_fp8_row's last greedy token on a GPU); it is checked on its own below
    schedule = triton_schedule(tmp_path, "overlap", backend=backend, **({"fp4_matvec": "words"} if backend == "triton" else {}))
    with sluice.load(store, device=DEVICE, schedule=schedule) as engine:
        logits, steps = teacher_forced(engine, PROMPT, ref_tokens)
    tokens = steps.argmax(-1).tolist()
    top1 = (sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), ref_logits.argmax(-1).tolist()))
            + sum(int(a == b) for a, b in zip(tokens, ref_tokens))) / (len(PROMPT) + n)
    kl = mean_kl(ref_logits, logits)
    diff = max((logits - ref_logits).abs().max().item(), (steps - ref_steps).abs().max().item())
    report = f"{case}/{backend}: top-1 agreement {top1:.3f}, mean KL {kl:.2e}, max |dlogit| {diff:.2e} (prompt and decode steps)"
    print(report)
    assert top1 == 1.0 and kl < 1e-8 and mean_kl(ref_steps, steps) < 1e-8, report
    assert_logits_close(case, logits, ref_logits, f"{case}/{backend}: prompt")
    assert_logits_close(case, steps, ref_steps, f"{case}/{backend}: decode steps")


def test_store_keeps_the_checkpoint_bytes(quantized):
    store = ExpertStore.open(quantized["nemotron_nvfp4_all"][0])
    m = store.manifest
    assert m.formats["up"].kind == "nvfp4" and m.formats["down"].kind == "nvfp4"
    names = {s.name for s in m.slots}
    assert {"up.weight", "up.weight_scale", "up.weight_scale_2", "down.weight", "down.weight_scale"} <= names
    down = next(s for s in m.slots if s.name == "down.weight_scale")
    assert down.relaid and down.stored_shape == (down.shape[1], down.shape[0])  # scales grouped per 16 neurons
    from sluice.storage.verify import verify

    assert verify(store.path, progress=False) == []


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_ct", "fp8", "fp8_row", "fp8_block", "fp8_block_e8m0", "mxfp4_ds"])
def test_quant_linear_kernels(fmt):
    """The resident quantised linear through the kernels (interpreted on a CPU) vs its dequantised reference."""
    w = torch.randn(48, 64)
    tensors = quantize(w, fmt)
    from sluice.kernels.formats import detect_format
    from sluice.storage.safetensors_io import TORCH_TO_ST

    f = detect_format({s: (TORCH_TO_ST[t.dtype], tuple(t.shape)) for s, t in tensors.items()}, "w")
    bias = torch.randn(48)
    ql = QuantLinear(f, tensors, bias, 48, 64).to(DEVICE)
    dense = f.dequant_ref(tensors).double()
    for M in (1, 5, 21):
        x = torch.randn(M, 64, device=DEVICE)
        ref = x.double().cpu() @ dense.t() + bias.double()
        got = (ql._kernel(x) + ql.bias).cpu() if DEVICE == "cpu" else ql(x).cpu()
        assert got.shape == (M, 48)
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-5


def test_deepseek_v4_release_formats_kept(quantized):
    """DeepSeek-V4's FP4 experts stay I8 + E8M0 in the store; its FP8 linears run from their E8M0 block scales
    (kernel format fp8_block_e8m0), the grouped output projection one QuantLinear per group."""
    from sluice.kernels.dequant import FORMAT_CODES
    from sluice.kernels.linear import GroupedQuantLinear

    store_path, _ = quantized["deepseek_v4_release"]
    m = ExpertStore.open(store_path).manifest
    assert {p: f.kind for p, f in m.formats.items()} == {"gate": "mxfp4", "up": "mxfp4", "down": "mxfp4"}
    dtypes = {s.name: s.dtype for s in m.slots}
    assert dtypes["gate.weight"] == "I8" and dtypes["gate.scale"] == "F8_E8M0"
    with sluice.load(store_path, device=DEVICE) as engine:
        modules = list(engine.model.hf.modules())
    grouped = [x for x in modules if isinstance(x, GroupedQuantLinear)]
    linears = [x for x in modules if isinstance(x, QuantLinear)]
    assert grouped and len(grouped[0].groups) == engine.model.config.o_groups
    assert linears and all(x.layout.fmt == FORMAT_CODES["fp8_block_e8m0"] for x in linears)


def test_e8m0_block_scales_read_as_f32_must_fail():
    """The same bytes under the F32 block-scale code give wrong rows: the format code is what reads them right."""
    from dataclasses import replace

    from sluice.kernels.dequant import FORMAT_CODES
    from sluice.kernels.formats import detect_format
    from sluice.storage.safetensors_io import TORCH_TO_ST

    w = torch.randn(64, 64)
    t = quantize(w, "fp8_block_e8m0")
    f = detect_format({s: (TORCH_TO_ST[x.dtype], tuple(x.shape)) for s, x in t.items()}, "w")
    ql = QuantLinear(f, t, None, 64, 64).to(DEVICE)
    x = torch.randn(1, 64, device=DEVICE)
    ref = x.double().cpu() @ f.dequant_ref(t).double().t()
    assert float((ql._kernel(x).cpu().double() - ref).norm() / ref.norm()) < 1e-5
    ql.layout = replace(ql.layout, fmt=FORMAT_CODES["fp8_block"])
    assert not torch.allclose(ql._kernel(x).cpu().double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case, base", [  # CI's suite: NVFP4 (ReLU^2, zero-skip) and FP8 (SwiGLU) once each (slow interpreted)
    ("nemotron_nvfp4_all", "zero-skip"), pytest.param("nemotron_fp8", "zero-skip", marks=pytest.mark.slow),
    ("qwen_fp8_block_all", "overlap"), pytest.param("qwen_nvfp4_ct", "overlap", marks=pytest.mark.slow)])
def test_fp4_matvec_f16x2_keeps_the_reference_tokens(case, base, quantized, tmp_path):
    """compute's `fp4_matvec: f16x2` (NVFP4 one-token matvecs with fp16 products, Hopper's e4m3 conversion on CUDA, its
    Triton twin here; for ReLU^2 experts the re-laid down too, NVFP4 or FP8): greedy tokens the reference's; logits
    within fp16 rounding, not fp32's."""
    store, ref_path = quantized[case]
    n = 32 if DEVICE != "cpu" else 3  # interpreted on a CPU: a few steps (~5 s each)
    ref_logits, ref_tokens, _ = _reference(ref_path, n)
    schedule = triton_schedule(tmp_path, base, backend="triton", fp4_matvec="f16x2")
    with sluice.load(store, device=DEVICE, schedule=schedule) as engine:
        seq = engine.new_sequence()
        tokens = engine.generate(PROMPT, n)
        first = engine.extend(seq, PROMPT)[-1]
        step = engine.extend(seq, [int(first.argmax())])[-1].cpu()  # a one-token step: the f16x2 matvecs
        kern = engine.rt.stats.kernels[0]
    assert kern.fp4_words == 3 and tokens == ref_tokens, f"{case}: greedy tokens differ"
    ref_model = __import__("conftest", fromlist=["References"]).References({"m": ref_path})
    ref_step = ref_model.logits("m", PROMPT + [int(first.argmax())])[-1]
    print(f"{case}: f16x2 step max |dlogit| {(step - ref_step).abs().max().item():.2e}, KL {mean_kl(ref_step[None], step[None]):.2e}")
    assert mean_kl(ref_step[None], step[None]) < 1e-5 and (step - ref_step).abs().max().item() < 1e-2


def test_hybrid_cpu_int8_knob_reaches_the_cpu_experts(quantized, tmp_path):
    """The compute stage's `cpu_int8` builds the hybrid path's CPU experts with int8 activations where the machine
    has AVX-512 VNNI. The tiny model's FP4 rows (32 inputs) are below the int8 kernels' 64-byte steps, so they fall
    back to the fp32 kernels and the reference's tokens hold; the int8 arithmetic itself is tested at real widths in
    tests/test_cpu_kernels.py."""
    import yaml

    from sluice.kernels.cpu_native import native_kernels
    from sluice.pipeline.schedule import SCHEDULES_DIR

    store, ref_path = quantized["nemotron_nvfp4_all"]
    _, ref_tokens, _ = _reference(ref_path, 6)
    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["h2d"] = {**(doc["stages"]["h2d"] or {}), "cpu_share": 1.0}
    doc["stages"]["compute"] = {**(doc["stages"]["compute"] or {}), "cpu_compile": False, "cpu_int8": True}
    path = tmp_path / "hybrid-int8.yaml"
    path.write_text(yaml.safe_dump(doc))
    with sluice.load(store, device=DEVICE, schedule=str(path)) as engine:
        assert engine.generate(PROMPT, 6) == ref_tokens
        stage = next(s for spec, s in engine.coordinator.stages if spec.name == "compute")
        assert stage._cpu and engine.rt.stats.cpu_blocks > 0
        lib = native_kernels()
        assert all(c.int8 == bool(lib is not None and lib.sluice_q8_available()) for c in stage._cpu.values())
