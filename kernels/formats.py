"""Weight formats as checkpoints store them, detected from tensor names, dtypes and shapes.

    dense      weight float (F32 / BF16 / F16)                                       [out, in]
    fp8        weight F8_E4M3 [out, in]; weight_scale F32, one per tensor or per row
    fp8_block  weight F8_E4M3 [out, in]; weight_scale_inv F32 [ceil(out/128), ceil(in/128)];
               DeepSeek-V4 names it weight / scale, its scale F32 or E8M0 (2**(s - 127))
    nvfp4      weight U8 [out, in/2] (low nibble = even element, E2M1), weight_scale F8_E4M3
               [out, in/16], weight_scale_2 F32 scalar (ModelOpt); compressed-tensors names it
               weight_packed / weight_scale / weight_global_scale and stores the global scale inverted
    mxfp4      weight U8 [out, in/2] (E2M1 nibbles as NVFP4), weight_scale U8 [out, in/32] (E8M0:
               2**(s - 127)); OCP microscaling as gpt-oss ships it (its `*_blocks` / `*_scales`) and
               DeepSeek-V4's FP4 experts (weight I8, scale F8_E8M0)
Any of them may carry a `bias` [out] (gpt-oss experts do).

W[o, i] = E2M1[nibble] * fp32(weight_scale[o, i // 16]) * weight_scale_2 for NVFP4,
W[o, i] = E2M1[nibble] * 2**(weight_scale[o, i // 32] - 127) for MXFP4. The `*_ref`
functions here are the plain-torch dequantisation every kernel is tested against; they in turn are
tested against nvidia-modelopt's own NVFP4 code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from sluice.errors import CheckpointError

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_GROUP = 16
MXFP4_GROUP = 32
FP8_BLOCK = 128
FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class WeightFormat:
    """How one linear weight is stored: its kind and which tensor suffix holds what."""

    kind: str  # dense | fp8 | fp8_block | nvfp4 | mxfp4
    weight: str = "weight"  # suffix of the (packed) weight
    scale: str | None = None  # per-group / per-row / per-block scale
    scale2: str | None = None  # NVFP4 second-level (global) scale
    scale2_inverted: bool = False  # compressed-tensors stores 1 / scale_2
    block: int = 0  # fp8_block tile edge
    bias: str | None = None  # suffix of the output bias, when the linear has one

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "WeightFormat":
        return cls(**d)

    def dequant_ref(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain-torch dequantisation: tensors by suffix (checkpoint orientation) -> [out, in] in dtype."""
        w = t[self.weight]
        if self.kind == "dense":
            return w.to(dtype)
        if self.kind == "fp8":
            s = t[self.scale].float()
            s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(())
            return (w.float() * s).to(dtype)
        if self.kind == "fp8_block":
            return fp8_block_dequant_ref(w, t[self.scale], self.block).to(dtype)
        if self.kind == "nvfp4":
            s2 = t[self.scale2].float().reshape(())
            if self.scale2_inverted:
                s2 = 1.0 / s2
            return nvfp4_dequant_ref(w, t[self.scale], s2).to(dtype)
        if self.kind == "mxfp4":
            return mxfp4_dequant_ref(w, t[self.scale]).to(dtype)
        raise ValueError(f"unknown weight format {self.kind!r}")


def nvfp4_dequant_ref(packed: torch.Tensor, scale: torch.Tensor, scale2: torch.Tensor | float) -> torch.Tensor:
    """packed uint8 [out, in/2], scale e4m3 [out, in/16], scale2 fp32 scalar -> fp32 [out, in]."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    vals = torch.stack([lut[p & 0xF], lut[p >> 4]], dim=-1).reshape(packed.shape[0], -1)  # low nibble first
    s = (scale.float() * torch.as_tensor(scale2, dtype=torch.float32)).repeat_interleave(NVFP4_GROUP, dim=1)[:, : vals.shape[1]]
    return vals * s


def mxfp4_dequant_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [out, in/2], scale E8M0 bytes (uint8 or float8_e8m0fnu) [out, in/32] -> fp32 [out, in]."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    p = packed.view(torch.uint8).to(torch.int64)  # DeepSeek-V4 stores the bytes as I8
    vals = torch.stack([lut[p & 0xF], lut[p >> 4]], dim=-1).reshape(packed.shape[0], -1)
    return vals * e8m0_to_f32(scale).repeat_interleave(MXFP4_GROUP, dim=1)[:, : vals.shape[1]]


def e8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 2**(e - 127), computed here rather than by torch's cast."""
    e = scale.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones(e.shape, device=e.device), e)


def fp8_block_dequant_ref(w: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """w e4m3 [out, in], scale_inv fp32 or E8M0 [ceil(out/b), ceil(in/b)] -> fp32 [out, in] (edges of any size)."""
    out, inp = w.shape
    s = e8m0_to_f32(scale_inv) if scale_inv.dtype == torch.float8_e8m0fnu else scale_inv.float()
    s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    return w.float() * s


def detect_format(suffixes: dict[str, tuple[str, tuple[int, ...]]], where: str) -> WeightFormat:
    """Which format a projection is stored in, from {suffix: (safetensors dtype, shape)}."""
    names = set(suffixes) - {"input_scale", "input_global_scale", "bias"}
    fmt = _weight_format(names, suffixes, where)
    if "bias" not in suffixes:
        return fmt
    out = suffixes[fmt.weight][1][0]
    if suffixes["bias"][0] not in FLOAT_DTYPES or suffixes["bias"][1] != (out,):
        raise CheckpointError(f"{where}: bias of {suffixes['bias'][0]}{list(suffixes['bias'][1])} does not match {out} output features")
    return replace(fmt, bias="bias")


def _weight_format(names: set[str], suffixes: dict[str, tuple[str, tuple[int, ...]]], where: str) -> WeightFormat:

    def dtype(s):
        return suffixes[s][0]

    if names == {"weight"} and dtype("weight") in FLOAT_DTYPES:
        return WeightFormat("dense")
    if names == {"weight", "weight_scale", "weight_scale_2"} and dtype("weight") == "U8" and dtype("weight_scale") == "F8_E4M3":
        return WeightFormat("nvfp4", "weight", "weight_scale", "weight_scale_2")
    if names == {"weight_packed", "weight_scale", "weight_global_scale"} and dtype("weight_scale") == "F8_E4M3":
        return WeightFormat("nvfp4", "weight_packed", "weight_scale", "weight_global_scale", scale2_inverted=True)
    for scale in ("weight_scale", "scale"):  # gpt-oss (after its blocks are cut) / DeepSeek-V4
        if names == {"weight", scale} and dtype("weight") in ("U8", "I8") and dtype(scale) in ("U8", "F8_E8M0"):
            (out, half), shape = suffixes["weight"][1], suffixes[scale][1]
            if shape != (out, -(-2 * half // MXFP4_GROUP)):
                raise CheckpointError(f"{where}: MXFP4 scales {list(shape)} do not match weight bytes {[out, half]} (one per 32 inputs)")
            return WeightFormat("mxfp4", "weight", scale)
    if names == {"weight", "weight_scale"} and dtype("weight") == "F8_E4M3":
        out = suffixes["weight"][1][0]
        n = 1
        for d in suffixes["weight_scale"][1]:
            n *= d
        if n not in (1, out):
            raise CheckpointError(f"{where}: FP8 weight_scale of shape {list(suffixes['weight_scale'][1])} is neither per-tensor nor per-row")
        return WeightFormat("fp8", "weight", "weight_scale")
    for scale in ("weight_scale_inv", "scale"):  # DeepSeek-V3 / DeepSeek-V4 (F32 or E8M0 scales)
        if names == {"weight", scale} and dtype("weight") == "F8_E4M3" and dtype(scale) in ("F32", "F8_E8M0") and len(suffixes[scale][1]) == 2:
            out, inp = suffixes["weight"][1]
            so, si = suffixes[scale][1]
            # 128 is the standard tile; dividing out by the scale rows would be wrong for edges (1856 / 15 != 128)
            block = next((b for b in (FP8_BLOCK, 64, 256, 32) if -(-out // b) == so and -(-inp // b) == si), None)
            if block is None:
                raise CheckpointError(f"{where}: FP8 block scales {so}x{si} do not tile a {out}x{inp} weight in square blocks")
            return WeightFormat("fp8_block", "weight", scale, block=block)
    found = ", ".join(f"{k}:{v[0]}{list(v[1])}" for k, v in sorted(suffixes.items()))
    raise CheckpointError(f"{where}: unsupported weight format ({found})")


def random_weight(shape: tuple[int, int], kind: str, device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                  dense_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random but valid checkpoint tensors (by suffix) of a [out, in] weight in `kind`, without quantising anything.

    For benchmarks and synthetic checkpoints: every NVFP4 nibble value, finite E4M3 codes, scales of
    a plausible size. kind: bf16 | fp16 | fp32 | fp8 | fp8_block | nvfp4 | mxfp4."""
    out, inp = shape
    g = generator

    def randint(*size, high=256):
        return torch.randint(0, high, size, dtype=torch.uint8, generator=g, device=device)

    def e4m3(*size, lo=0.25, hi=2.0):
        return (torch.rand(*size, generator=g, device=device) * (hi - lo) + lo).to(torch.float8_e4m3fn)

    def fp8_weights():
        b = randint(out, inp) & 0x7E  # no NaN codes (0x7F / 0xFF), both signs via the xor below
        return (b ^ (randint(out, inp) & 0x80)).view(torch.float8_e4m3fn)

    if kind in ("bf16", "fp16", "fp32"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
        return {"weight": (torch.randn(out, inp, generator=g, device=device) * 0.02).to(dt)}
    if kind == "fp8":
        return {"weight": fp8_weights(), "weight_scale": torch.full((), 1e-3, device=device)}
    if kind == "fp8_block":
        so, si = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
        return {"weight": fp8_weights(), "weight_scale_inv": torch.rand(so, si, generator=g, device=device) * 1e-3 + 1e-4}
    if kind == "nvfp4":
        if inp % NVFP4_GROUP:
            raise ValueError(f"NVFP4 needs in_features divisible by {NVFP4_GROUP}, got {inp}")
        return {"weight": randint(out, inp // 2), "weight_scale": e4m3(out, inp // NVFP4_GROUP),
                "weight_scale_2": torch.full((), 1e-2, device=device), "input_scale": torch.ones((), device=device)}
    if kind == "mxfp4":
        if inp % MXFP4_GROUP:
            raise ValueError(f"MXFP4 needs in_features divisible by {MXFP4_GROUP}, got {inp}")
        exps = torch.randint(127 - 9, 127 - 5, (out, inp // MXFP4_GROUP), generator=g, device=device).to(torch.uint8)  # 2**-9 .. 2**-6
        return {"weight": randint(out, inp // 2), "weight_scale": exps}
    raise ValueError(f"unknown weight kind {kind!r}")
