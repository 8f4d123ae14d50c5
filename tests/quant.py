"""Test-side quantisers (checkpoint layouts) and block builders for the kernel tests.

NVFP4 comes from nvidia-modelopt's own NVFP4QTensor, so our decode is checked against code we did
not write. FP8 here is a plain cast with per-tensor / per-row / per-block scales; MXFP4 is the
tiny-checkpoint quantiser (tests/tiny.py), its decode checked against transformers' own.

A GPU run (SLUICE_TEST_DEVICE not cpu) on a machine without modelopt (the GPU machine's image has none) makes its
NVFP4 weights with a plain round-to-nearest quantiser and dequantises them with our reference decode, so that the
GPU's NVFP4 kernels are still tested there; the decode's check against modelopt itself runs where modelopt is
installed (CI), and its absence fails everywhere else.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from sluice.kernels.formats import nvfp4_dequant_ref

from sluice.kernels.formats import WeightFormat, detect_format
from sluice.storage.safetensors_io import TORCH_TO_ST
from sluice.storage.store import Manifest, pack_block, plan_layout

FORMATS = ("bf16", "fp32", "fp8", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "nvfp4_ct", "mxfp4", "mxfp4_ds")


def modelopt_nvfp4():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


def _modelopt_or_none():
    """modelopt's NVFP4QTensor; None on a GPU run without modelopt (see above); elsewhere its absence raises."""
    try:
        return modelopt_nvfp4()
    except ImportError:
        if os.environ.get("SLUICE_TEST_DEVICE", "cpu") == "cpu":
            raise
        return None


def need_modelopt():
    """For tests of our decode against modelopt's: skipped on a GPU run without it (they run in CI)."""
    if _modelopt_or_none() is None:
        pytest.skip("nvidia-modelopt is not installed on this GPU machine; the check runs in CI")


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nvfp4_nearest(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (packed uint8 [out, in/2] with the first element in the low nibble, E4M3 scale per 16 inputs,
    fp32 global scale): each group's scale its largest |w| / 6 over the global scale (1 for an all-zero group, as
    modelopt has it), each element the nearest E2M1."""
    out, inp = w.shape
    groups = w.float().reshape(out, inp // 16, 16)
    s2 = (w.abs().amax().float() / (6 * 448)).clamp(min=1e-30)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax == 0, 1.0, amax / 6 / s2).to(torch.float8_e4m3fn)
    x = groups / (scale.float() * s2).clamp(min=1e-30)[..., None]
    code = ((x.abs()[..., None] - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)).reshape(out, inp)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8), scale, s2.reshape(())


def quantize(w: torch.Tensor, fmt: str, block: int = 32) -> dict[str, torch.Tensor]:
    """w [out, in] fp32 -> checkpoint tensors by suffix, in `fmt`."""
    assert w.dim() == 2, f"a weight matrix is 2-D, got {tuple(w.shape)}"
    if fmt == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    if fmt == "fp32":
        return {"weight": w.float()}
    if fmt in ("fp8", "fp8_row"):
        amax = w.abs().amax() if fmt == "fp8" else w.abs().amax(dim=1, keepdim=True)
        scale = (amax / 448.0).clamp(min=1e-12).float()
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(()) if fmt == "fp8" else scale}
    if fmt in ("fp8_block", "fp8_block_e8m0"):  # the second as DeepSeek-V4 ships it: power-of-two scales, E8M0
        out, inp = w.shape
        so, si = -(-out // block), -(-inp // block)
        scale = torch.empty(so, si)
        q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
        for i in range(so):
            for j in range(si):
                tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
                s = (tile.abs().amax() / 448.0).clamp(min=1e-12)
                if fmt == "fp8_block_e8m0":
                    s = torch.exp2(torch.ceil(torch.log2(s)))
                scale[i, j] = s
                q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
        if fmt == "fp8_block":
            return {"weight": q, "weight_scale_inv": scale}
        return {"weight": q, "scale": (torch.log2(scale) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)}
    if fmt in ("nvfp4", "nvfp4_ct"):
        cls = _modelopt_or_none()
        if cls is None:
            packed, s, s2 = _nvfp4_nearest(w)
        else:
            q, s, s2 = cls.quantize(w.float(), 16)
            packed = q._quantized_data
        if fmt == "nvfp4":
            return {"weight": packed, "weight_scale": s, "weight_scale_2": s2.float().reshape(()), "input_scale": torch.ones(())}
        return {"weight_packed": packed, "weight_scale": s, "weight_global_scale": (1.0 / s2.float()).reshape(())}
    if fmt in ("mxfp4", "mxfp4_ds"):  # gpt-oss's blocks cut per expert; DeepSeek-V4's I8 + F8_E8M0 `scale`
        from tiny import quantize_mxfp4

        blocks, scales = quantize_mxfp4(w.float())
        if fmt == "mxfp4":
            return {"weight": blocks.reshape(w.shape[0], -1), "weight_scale": scales}
        return {"weight": blocks.reshape(w.shape[0], -1).view(torch.int8), "scale": scales.view(torch.float8_e8m0fnu)}
    raise ValueError(fmt)


def modelopt_dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """NVFP4 checkpoint tensors -> fp32 through modelopt's own dequantize (the independent reference; on a GPU run
    without modelopt, our reference decode)."""
    cls = _modelopt_or_none()
    packed = t.get("weight", t.get("weight_packed"))
    s2 = t["weight_scale_2"] if "weight_scale_2" in t else 1.0 / t["weight_global_scale"]
    if cls is None:
        return nvfp4_dequant_ref(packed, t["weight_scale"], s2)
    q = cls(torch.Size([packed.shape[0], packed.shape[1] * 2]), torch.float32, packed)
    return q.dequantize(dtype=torch.float32, scale=t["weight_scale"], double_scale=s2.float(), block_sizes={-1: 16})


def make_bank(kind: str, fmt: str, A: int, Dx: int, I: int, seed: int = 0, scale: float = 0.2, bias: bool = False):
    """A bank of A expert blocks (the store's layout) with random weights in `fmt` (and fp32 biases).

    Returns (bank uint8 [A * block_bytes], offsets int64 [A], manifest, dense fp32 weights per expert:
    proj -> [out, in], and "<proj>.bias" -> [out] with `bias`)."""
    g = torch.Generator().manual_seed(seed)
    projs = ("up", "down") if kind == "relu2" else ("gate", "up", "down")
    experts = []
    for _ in range(A):
        ws = {}
        for p in projs:
            shape = (Dx, I) if p == "down" else (I, Dx)
            ws[p] = torch.randn(*shape, generator=g) * scale
        experts.append(ws)
    quantized = [{p: quantize(ws[p], fmt) for p in projs} for ws in experts]
    if bias:
        for q in quantized:
            for p in projs:
                q[p]["bias"] = torch.randn(Dx if p == "down" else I, generator=g) * scale
    entries, formats = [], {}
    for p in projs:
        t0 = quantized[0][p]
        formats[p] = detect_format({s: (TORCH_TO_ST[t.dtype], tuple(t.shape)) for s, t in t0.items()}, p)
        for sfx, t in t0.items():
            entries.append((p, sfx, tuple(t.shape), TORCH_TO_ST[t.dtype], t.numel() * t.element_size(), p == "down" and kind == "relu2" and t.dim() == 2))
    slots, block_bytes = plan_layout(entries)
    manifest = Manifest("test", kind, A, 1, block_bytes, slots, formats, (), {})
    bank = torch.zeros(A * block_bytes, dtype=torch.uint8)
    for a, q in enumerate(quantized):
        named = {f"{p}.{sfx}": t for p, tensors in q.items() for sfx, t in tensors.items()}
        pack_block(slots, named, bank[a * block_bytes : (a + 1) * block_bytes])
    assert block_bytes % 4096 == 0 and all(s.offset + s.nbytes <= block_bytes for s in slots)
    offsets = torch.arange(A, dtype=torch.int64) * block_bytes
    dense = [{p: WeightFormat.dequant_ref(formats[p], q[p]) for p in projs} for q in quantized]
    if bias:
        for d, q in zip(dense, quantized):
            d.update({f"{p}.bias": q[p]["bias"] for p in projs})
    return bank, offsets, manifest, dense


def quantize_checkpoint(src, dst, ref, fmt: str, resident: bool | str = False):
    """Quantise a tiny checkpoint's routed experts into `fmt` (and, with `resident`, its other linears:
    into `fmt` too, or the format `resident` names).

    Writes the quantised checkpoint to `dst` (checkpoint names, hf_quant_config.json for ModelOpt
    formats) and, to `ref`, the same model with every quantised weight replaced by its
    dequantisation through code we did not write where there is one (modelopt for NVFP4): the
    reference transformers runs on."""
    import json
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst, ref = Path(src), Path(dst), Path(ref)
    tensors = load_file(src / "model.safetensors")
    expert = re.compile(r"\.experts\.\d+\.(\w+_proj|w[123])\.weight$")
    resident_linear = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|in_proj|out_proj|up_proj|down_proj|gate_proj|fc1_latent_proj|fc2_latent_proj"
                                 r"|wq_a|wq_b|wkv|wgate|wo_a|wo_b|w1|w2|w3)\.weight$")  # the last: DeepSeek-V4's names
    out, deq, quantized = {}, {}, []
    for name, w in tensors.items():
        routed = expert.search(name) is not None
        if routed or (resident and resident_linear.search(name) and ".experts." not in name):
            q = quantize(w.float(), fmt if routed or resident is True else resident)
            module = name[: -len(".weight")]
            out.update({f"{module}.{sfx}": t for sfx, t in q.items()})
            if "weight_scale_2" in q or "weight_global_scale" in q:
                deq[name] = modelopt_dequant(q)
            else:
                deq[name] = detect_format({s: (TORCH_TO_ST[t.dtype], tuple(t.shape)) for s, t in q.items()}, name).dequant_ref(q)
            quantized.append(module)
        else:
            out[name] = w
            deq[name] = w
    for d in (dst, ref):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, ref / "model.safetensors", metadata={"format": "pt"})
    if fmt == "mxfp4_ds":  # what DeepSeek-V4-Flash's config.json says
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(expert_dtype="fp4", quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                             "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if fmt in ("nvfp4", "fp8"):
        algo = {"nvfp4": "NVFP4", "fp8": "FP8"}[fmt]
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}}))
    return dst, ref
