"""CPU expert kernels: one token through one routed expert, read where the block sits in (pinned) RAM,
in the checkpoint's format and the store's orientation (a ReLU^2 `down` re-laid K-major), with no
dequantised copy of the weights. This is the CPU side of the hybrid miss path: while the GPU computes
the experts it copied, the CPU computes others straight from the RAM cache.

Each projection is a matvec written as elementwise torch ops and one reduction over the stored bytes
(nibbles looked up in the E2M1 table, scales applied per group, products summed), which
torch.compile's C++ backend fuses into one vectorised, multi-threaded pass over the weights
(`compile=False` runs the same ops eagerly: slower, same arithmetic up to summation order).
FP4, FP8 and BF16 projections take a native path when the machine has a C compiler (kernels/cpu_native.py,
faster: BENCHMARKS.md); without one the torch path serves. `q8_reference` is the arithmetic of the native int8
FP4 path in float64.
Reference: kernels/formats.py's dequantisation + kernels/experts_ref.py (tests/test_cpu_kernels.py).

Shapes, as stored: FP4 weight [N, K/2] bytes (re-laid [K/2, N]), group scales [N, K/g] (re-laid
[K/g, N]); dense / FP8 weight [N, K] (re-laid [K, N]); x [K] fp32 -> y [N] fp32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from sluice.kernels.cpu_native import ExpertPlan, Fp4Call, bf16_matvec_native, fp4_matvec_native, fp8_matvec_native, native_kernels
from sluice.kernels.formats import MXFP4_GROUP, NVFP4_GROUP, WeightFormat


def e8m0_f32(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2**(e - 127) by placing e in the exponent bits (e = 0 reads as 0, as the GPU kernels)."""
    return (e.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def e4m3_f32(v: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32 in integer ops and a bitcast (torch's own cast does not vectorise in the compiled
    loops): sign, exponent rebased from 7 to 127 and mantissa moved into place; subnormals m * 2**-9."""
    b = v.view(torch.uint8).to(torch.int32)
    e, m = (b >> 3) & 15, b & 7
    normal = (((b & 128) << 24) | ((e + 120) << 23) | (m << 20)).view(torch.float32)
    sub = m.float() * (1.0 / 512) * (1 - ((b >> 6) & 2))
    return torch.where(e == 0, sub, normal)


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (int32 0..15) -> fp32 values in integer ops, no table: with exponent e and mantissa
    bit m, |value| * 4 is 2m for e = 0 and (2 + m) << e otherwise; bit 3 is the sign."""
    m, e = code & 1, (code >> 1) & 3
    q = torch.where(e == 0, 2 * m, (2 + m) << e)
    return (q * (1 - ((code >> 2) & 2))).float() * 0.25


def fp4_matvec(packed: torch.Tensor, scale: torch.Tensor, xe: torch.Tensor, xo: torch.Tensor, group: int, e8m0: bool,
               kmajor: bool) -> torch.Tensor:
    """E2M1 nibbles (low nibble = even input) times their group scales, dotted with x = (xe, xo) interleaved
    (given apart, contiguous: strided loads of x keep the compiled loop from vectorising, ~20 x slower)."""
    p = packed.view(torch.uint8).to(torch.int32)
    lo, hi = e2m1(p & 15), e2m1(p >> 4)
    s = e8m0_f32(scale) if e8m0 else e4m3_f32(scale)
    half = group // 2  # bytes per scale group along K
    if kmajor:  # [K/2, N]
        t = lo * xe[:, None] + hi * xo[:, None]
        t = F.pad(t, (0, 0, 0, -t.shape[0] % half))  # a last, partial group
        g = t.shape[0] // half
        return (t.view(g, half, t.shape[1]) * s[:g, None, :]).sum((0, 1))
    t = lo * xe[None, :] + hi * xo[None, :]
    t = F.pad(t, (0, -t.shape[1] % half))
    g = t.shape[1] // half
    return (t.view(t.shape[0], g, half) * s[:, :g, None]).sum((1, 2))


def _f32(w: torch.Tensor) -> torch.Tensor:
    return e4m3_f32(w) if w.dtype == torch.float8_e4m3fn else w.float()


def dense_matvec(w: torch.Tensor, x: torch.Tensor, kmajor: bool) -> torch.Tensor:
    return (_f32(w) * x[:, None]).sum(0) if kmajor else (_f32(w) * x[None, :]).sum(1)


def fp8_block_matvec(w: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, block: int, e8m0: bool, kmajor: bool) -> torch.Tensor:
    """FP8 weights with one scale per block x block tile (edges of any size), scales in the weight's orientation."""
    s = e8m0_f32(scale) if e8m0 else scale.float()
    rows = torch.arange(w.shape[0]) // block
    cols = torch.arange(w.shape[1]) // block
    t = _f32(w) * s[rows][:, cols]
    return (t * x[:, None]).sum(0) if kmajor else (t * x[None, :]).sum(1)


_KERNELS: dict[tuple[str, bool], Callable] = {}
def q8_reference(packed: torch.Tensor, scale: torch.Tensor, xe: torch.Tensor, xo: torch.Tensor, group: int, e8m0: bool,
                 kmajor: bool) -> torch.Tensor:
    """The int8 path's arithmetic in float64: x's even and odd elements rounded (half to even) to int8 steps of
    max|x| / 127 per scale group, then fp4_matvec's sum on them; exact up to the kernels' fp32 summation order."""
    half = group // 2
    xe, xo = xe.double(), xo.double()
    m = torch.maximum(xe.abs().view(-1, half).amax(1), xo.abs().view(-1, half).amax(1)).float()
    inv = torch.where(m > 0, 127.0 / m, torch.zeros_like(m)).repeat_interleave(half)
    step = (m / 127.0).double().repeat_interleave(half)
    qe, qo = torch.round(xe.float() * inv).double() * step, torch.round(xo.float() * inv).double() * step
    return _fp4_matvec_f64(packed, scale, qe, qo, group, e8m0, kmajor)


def _fp4_matvec_f64(packed, scale, xe, xo, group, e8m0, kmajor) -> torch.Tensor:
    """fp4_matvec in float64 (the reference for the int8 path's exact integer sums)."""
    pk = packed.view(torch.uint8).to(torch.int32)
    lo, hi = e2m1(pk & 15).double(), e2m1(pk >> 4).double()
    s = (e8m0_f32(scale) if e8m0 else e4m3_f32(scale)).double()
    half = group // 2
    if kmajor:  # [K2, N], scales [K2/half, N]
        t = lo * xe[:, None] + hi * xo[:, None]
        return (t.view(-1, half, t.shape[1]) * s[:, None, :]).sum((0, 1))
    t = lo * xe[None, :] + hi * xo[None, :]
    return (t.view(t.shape[0], -1, half) * s[:, :, None]).sum((1, 2))


def _kernel(name: str, fn: Callable, compiled: bool) -> Callable:
    if not compiled:
        return fn
    if (name, True) not in _KERNELS:
        _KERNELS[(name, True)] = torch.compile(fn, dynamic=False)
    return _KERNELS[(name, True)]


def proj_matvec(t: dict[str, torch.Tensor], fmt: WeightFormat, kmajor: bool, x: torch.Tensor, compiled: bool = True,
                native: bool = True, threads: int = 0) -> torch.Tensor:
    """One projection of one expert: tensors by suffix as stored, x [K] fp32 -> [N] fp32 (bias added).
    threads: the native kernels' OpenMP threads (0: torch's count)."""
    w = t[fmt.weight]
    if fmt.kind in ("nvfp4", "mxfp4"):
        mx = fmt.kind == "mxfp4"
        xe, xo = x[0::2].contiguous(), x[1::2].contiguous()
        lib = native_kernels() if native else None
        fp4 = (lambda *a: fp4_matvec_native(lib, *a, threads=threads)) if lib is not None else _kernel("fp4", fp4_matvec, compiled)
        y = fp4(w, t[fmt.scale], xe, xo, MXFP4_GROUP if mx else NVFP4_GROUP, mx, kmajor)
        if not mx:
            s2 = t[fmt.scale2].float().reshape(())
            y = y * (1.0 / s2 if fmt.scale2_inverted else s2)
    elif fmt.kind == "fp8_block":
        s = t[fmt.scale]
        lib = native_kernels() if native else None
        if lib is not None:
            y = fp8_matvec_native(lib, w, s, x, fmt.block, kmajor, threads)
        else:
            y = _kernel("fp8_block", fp8_block_matvec, compiled)(w, s, x, fmt.block, s.dtype == torch.float8_e8m0fnu, kmajor)
    else:
        lib = native_kernels() if native and w.dtype in (torch.float8_e4m3fn, torch.bfloat16) else None
        if lib is not None and w.dtype == torch.bfloat16:
            y = bf16_matvec_native(lib, w, x, kmajor, threads)
        elif lib is not None:
            y = fp8_matvec_native(lib, w, None, x, 0, kmajor, threads)
        else:
            y = _kernel("dense", dense_matvec, compiled)(w, x, kmajor)
        if fmt.kind == "fp8":
            s = t[fmt.scale].float()
            y = y * (s.reshape(-1) if s.numel() > 1 else s.reshape(()))
    if fmt.bias:
        y = y + t[fmt.bias].float()
    return y


def weighed_rows_ref(y: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype, out: torch.Tensor, rows: list[int]) -> None:
    """Experts' outputs y [n, Dx] fp32 rounded to the model's dtype, times their weights w [n], into out's rows: what
    the GPU's kernels write for a routed block (a row the combine sums in a fixed order)."""
    out[rows] = (y.to(x_dtype).float() * w[:, None]).to(out.dtype)


class CpuExperts:
    """A store's experts on the CPU, one token and one expert at a time (`run`) or a layer's blocks on one token
    (`run_many`), from block buffers (uint8 views of RAM slots). `act` / `glu` are the MoE block's own (transformers'
    activation, the model's gated unit). threads: the native kernels' OpenMP threads (0: torch's count). act_name "relu2" (with FP4 up and
    re-laid down) lets the native path run the whole expert in one call, as "silu" (plain SiLU, no `glu`) does for a
    SwiGLU FP4 expert."""

    def __init__(self, manifest, kind: str, act: Callable, glu: Callable | None = None, compiled: bool = True,
                 native: bool = True, threads: int = 0, act_name: str = "", int8: bool = False):
        m = manifest
        self.kind, self.act, self.glu, self.compiled, self.native, self.threads = kind, act, glu, compiled, native, threads
        self.formats: dict[str, WeightFormat] = m.formats
        self.slots = {proj: [s for s in m.slots if s.proj == proj] for proj in m.formats}
        self.kmajor = {proj: any(s.relaid and s.suffix == f.weight for s in self.slots[proj]) for proj, f in m.formats.items()}
        self.fp4 = {}  # proj -> Fp4Call, where the native FP4 kernel takes it straight from the block's bytes
        lib = native_kernels() if native else None
        if lib is not None:
            for proj, f in m.formats.items():
                slots = {s.suffix: s for s in self.slots[proj]}
                if f.kind in ("nvfp4", "mxfp4") and not f.bias and (f.kind == "mxfp4" or slots[f.scale2].dtype == "F32"):
                    self.fp4[proj] = Fp4Call(lib, f, slots, self.kmajor[proj], threads)
        up, down = self.fp4.get("up"), self.fp4.get("down")
        self.fused = (kind == "relu2" and act_name == "relu2" and up is not None and down is not None and not up.kmajor and down.kmajor
                      and (up.half, up.e8m0) == (down.half, down.e8m0) and up.n == 2 * down.k2)
        gate = self.fp4.get("gate")
        self.fused_swiglu = (kind == "swiglu" and act_name == "silu" and glu is None and gate is not None and up is not None
                             and down is not None and not (gate.kmajor or up.kmajor or down.kmajor)
                             and (gate.half, gate.e8m0) == (up.half, up.e8m0) == (down.half, down.e8m0)
                             and gate.n == up.n == 2 * down.k2 and down.n == 2 * up.k2)
        # FP4 projections with activations rounded to int8 per scale group (AVX-512 VNNI): ~0.5% off each output
        self.int8 = bool(int8 and self.fp4 and lib.sluice_q8_available())
        # a whole expert, or several of a layer for one token, in one native call
        self.plan = ExpertPlan.fp4(lib, kind, up, down, gate, self.int8) if self.fused or self.fused_swiglu else None
        if self.plan is None and lib is not None and act_name == ("relu2" if kind == "relu2" else "silu") and glu is None:
            self.plan = ExpertPlan.dense(lib, kind, self.formats, self.slots, self.kmajor, threads)  # BF16 / FP8

    def _proj(self, block: torch.Tensor, proj: str, x: torch.Tensor) -> torch.Tensor:
        if proj in self.fp4:
            return self.fp4[proj](block, x, self.int8)
        t = {s.suffix: s.view(block) for s in self.slots[proj]}
        return proj_matvec(t, self.formats[proj], self.kmajor[proj], x, self.compiled, self.native, self.threads)

    @torch.inference_mode()
    def run_many(self, blocks: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Several experts (blocks of one layer) on one token: x [Dx] fp32 -> [len(blocks), Dx] fp32; one native call
        where the experts run whole in C (`plan`)."""
        if self.plan is not None:
            return self.plan(blocks, x)
        return torch.stack([self.run(b, x) for b in blocks])

    @torch.inference_mode()
    def weighed_rows(self, blocks: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype, out: torch.Tensor,
                     rows: list[int]) -> None:
        """A MoE layer's host rows: each block's output on x [Dx] fp32 rounded to x_dtype, times its weight w [n] fp32,
        into out's `rows` (out [K, Dx]) as `weighed_rows_ref` writes them; in the native call where x_dtype is fp32 or
        bf16 and out a contiguous fp32 or bf16 tensor, else through `run_many`."""
        if self._native_rows(x, w, x_dtype, out):
            self.plan.rows(blocks, x, w, x_dtype == torch.bfloat16, out, rows)
        else:
            weighed_rows_ref(self.run_many(blocks, x), w, x_dtype, out, rows)

    @torch.inference_mode()
    def weighed_pairs(self, blocks: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype, out: torch.Tensor,
                      rows: list[int]) -> None:
        """`weighed_rows` with an input a block: block e on x[e] (x [n, Dx] fp32), a prompt's (block, row) pairs; a block's
        pairs side by side read it from RAM once in the native call."""
        if self._native_rows(x, w, x_dtype, out):
            self.plan.pairs(blocks, x, w, x_dtype == torch.bfloat16, out, rows)
        else:
            weighed_rows_ref(torch.stack([self.run(b, xe) for b, xe in zip(blocks, x)]), w, x_dtype, out, rows)

    def _native_rows(self, x: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype, out: torch.Tensor) -> bool:
        """Whether the native call writes these rows: a plan, fp32 or bf16 rounding and out, fp32 contiguous inputs."""
        return (self.plan is not None and x_dtype in (torch.float32, torch.bfloat16) and out.is_contiguous()
                and out.dtype in (torch.float32, torch.bfloat16) and x.dtype == w.dtype == torch.float32
                and x.is_contiguous() and w.is_contiguous())

    @torch.inference_mode()
    def run(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [Dx] fp32 -> the expert's output [Dx] fp32."""
        if self.plan is not None:
            return self.plan([block], x)[0]
        if self.kind == "relu2":
            h = self.act(self._proj(block, "up", x))
        else:
            g, u = self._proj(block, "gate", x), self._proj(block, "up", x)
            h = self.glu(g, u) if self.glu is not None else self.act(g) * u
        return self._proj(block, "down", h)
