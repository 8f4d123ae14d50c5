"""CPU expert kernels: one token through one routed expert, read where the block sits in (pinned) RAM,
in the checkpoint's format and the store's orientation (a ReLU^2 `down` re-laid K-major), with no
dequantised copy of the weights. This is the CPU side of the hybrid miss path: while the GPU computes
the experts it copied, the CPU computes others straight from the RAM cache.

Each projection is a matvec written as elementwise torch ops and one reduction over the stored bytes
(nibbles looked up in the E2M1 table, scales applied per group, products summed), which
torch.compile's C++ backend fuses into one vectorised, multi-threaded pass over the weights
(`compile=False` runs the same ops eagerly: slower, same arithmetic up to summation order).
FP4, FP8 and BF16 projections take a native path when the machine has a C compiler: kernels/cpu_native.c,
built once per machine under SLUICE_HOME/build (-O3 -march=native -fopenmp) and called through ctypes,
which releases the GIL; torch.compile's loops keep a short inner reduction per scale group that does
not vectorise well, and its E4M3 decode stays scalar (BENCHMARKS.md). Without a compiler the torch
path serves. `int8` (AVX-512 VNNI): FP4 projections with x rounded to int8 per scale group and the products
summed in int32 (vpdpbusd, 128 weights an instruction), exact sums of the rounded x (`q8_reference`), ~0.5% off
the fp32 result; opt-in (the compute stage's `cpu_int8`).
Reference: kernels/formats.py's dequantisation + kernels/experts_ref.py (tests/test_cpu_kernels.py).

Shapes, as stored: FP4 weight [N, K/2] bytes (re-laid [K/2, N]), group scales [N, K/g] (re-laid
[K/g, N]); dense / FP8 weight [N, K] (re-laid [K, N]); x [K] fp32 -> y [N] fp32.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

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
_NATIVE: list = []  # [ctypes library or None], once tried


def native_kernels():
    """The C FP4 / FP8 kernels (kernels/cpu_native.c) for this machine, built on first use; None without a compiler."""
    if _NATIVE:
        return _NATIVE[0]
    from sluice.log import get_logger
    from sluice.pipeline.config import sluice_home

    lib = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    src = Path(__file__).with_name("cpu_native.c")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    if cc is not None:
        cpu = platform.processor() + platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu += next((line for line in f if line.startswith("flags")), "")
        except OSError:
            pass
        key = hashlib.sha256(src.read_bytes() + " ".join([cc, *flags, cpu]).encode()).hexdigest()[:16]
        out = sluice_home() / "build" / f"cpu_native-{key}.so"
        try:
            if not out.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(f".{os.getpid()}.tmp")
                subprocess.run([cc, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
                os.replace(tmp, out)
            lib = ctypes.CDLL(str(out))
            args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
            for fn in (lib.sluice_fp4_nmajor, lib.sluice_fp4_kmajor):
                fn.argtypes, fn.restype = args, None
            fp8 = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
            for fn in (lib.sluice_fp8_nmajor, lib.sluice_fp8_kmajor):
                fn.argtypes, fn.restype = fp8, None
            ptr, long_, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
            lib.sluice_fp4_relu2_expert.argtypes = [ptr, ptr, long_, f32, ptr, ptr, long_, f32, ptr, ptr, long_, long_,
                                                    ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ptr]
            lib.sluice_fp4_relu2_expert.restype = None
            lib.sluice_fp4_relu2_expert_q8.argtypes = lib.sluice_fp4_relu2_expert.argtypes + [ptr, ptr, ptr]
            lib.sluice_fp4_relu2_expert_q8.restype = None
            lib.sluice_q8_prep.argtypes = [ptr, ptr, long_, ctypes.c_int, ptr, ptr, ptr, ptr]
            lib.sluice_q8_prep.restype = ctypes.c_int
            lib.sluice_fp4_q8.argtypes = [ptr, ptr, long_, ptr, ptr, ptr, ptr, long_, long_, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int, ptr]
            lib.sluice_fp4_q8.restype = ctypes.c_int
            lib.sluice_q8_available.restype = ctypes.c_int
            proj = [ptr, ptr, long_, f32]
            lib.sluice_fp4_swiglu_expert.argtypes = proj * 3 + [ptr, ptr, long_, long_, ctypes.c_int, ctypes.c_int] + [ptr] * 8 + [ctypes.c_int]
            lib.sluice_fp4_swiglu_expert.restype = None
            for fn in (lib.sluice_bf16_nmajor, lib.sluice_bf16_kmajor):
                fn.argtypes, fn.restype = [ptr, ptr, long_, long_, ptr], None
            lib.sluice_set_threads.argtypes = [ctypes.c_int]
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            get_logger().warning("CPU FP4/FP8 kernels: building the native path failed; using torch.compile's",
                                 error=(str(e) + " " + detail.decode(errors="replace"))[:300])
            lib = None
    _NATIVE.append(lib)
    return lib


def fp4_matvec_native(lib, packed: torch.Tensor, scale: torch.Tensor, xe: torch.Tensor, xo: torch.Tensor, group: int,
                      e8m0: bool, kmajor: bool, threads: int = 0) -> torch.Tensor:
    """fp4_matvec through kernels/cpu_native.c: the same result up to summation order."""
    p, s = packed.contiguous(), scale.contiguous()
    n = p.shape[0] if not kmajor else p.shape[1]
    k2 = p.shape[1] if not kmajor else p.shape[0]
    y = torch.empty(n, dtype=torch.float32)
    lib.sluice_set_threads(threads or torch.get_num_threads())
    fn = lib.sluice_fp4_kmajor if kmajor else lib.sluice_fp4_nmajor
    fn(p.data_ptr(), s.data_ptr(), s.stride(0), xe.data_ptr(), xo.data_ptr(), n, k2, group // 2, int(e8m0), y.data_ptr())
    return y


class Q8:
    """x's even and odd elements quantized to int8 per FP4 scale group (`half` bytes of the row: 16 or 32 inputs) for
    kernels/cpu_native.c's int8 path (AVX-512 VNNI): qe, qo [K2] int8, xs [K2/4] (each 4-byte quad's group scale / 2),
    corr [K2/4] int32 (12 * the quad's sum of qe + qo, which the kernels' offset table adds)."""

    def __init__(self, lib, xe: torch.Tensor, xo: torch.Tensor, half: int):
        k2 = xe.numel()
        self.qe, self.qo = torch.empty(k2, dtype=torch.int8), torch.empty(k2, dtype=torch.int8)
        self.xs, self.corr = torch.empty(k2 // 4 + 1, dtype=torch.float32), torch.empty(k2 // 4 + 1, dtype=torch.int32)
        self.ok = bool(lib.sluice_q8_prep(xe.data_ptr(), xo.data_ptr(), k2, half, self.qe.data_ptr(), self.qo.data_ptr(),
                                          self.xs.data_ptr(), self.corr.data_ptr()))  # False: not whole groups of quads

    def args(self) -> tuple[int, int, int, int]:
        return self.qe.data_ptr(), self.qo.data_ptr(), self.xs.data_ptr(), self.corr.data_ptr()


def fp4_matvec_q8_native(lib, packed: torch.Tensor, scale: torch.Tensor, xe: torch.Tensor, xo: torch.Tensor, group: int,
                         e8m0: bool, kmajor: bool, threads: int = 0) -> torch.Tensor | None:
    """fp4_matvec with x rounded to int8 per scale group (`q8_reference`'s arithmetic) through the VNNI kernels;
    None where they do not run (no AVX-512 VNNI, or sizes they do not take)."""
    p, s = packed.contiguous(), scale.contiguous()
    n, k2 = (p.shape[1], p.shape[0]) if kmajor else (p.shape[0], p.shape[1])
    y = torch.empty(n, dtype=torch.float32)
    lib.sluice_set_threads(threads or torch.get_num_threads())
    q = Q8(lib, xe.contiguous(), xo.contiguous(), group // 2)
    ran = q.ok and lib.sluice_fp4_q8(p.data_ptr(), s.data_ptr(), s.stride(0), *q.args(), n, k2, group // 2, int(e8m0), int(kmajor), y.data_ptr())
    return y if ran else None


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


def fp8_matvec_native(lib, w: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor, block: int, kmajor: bool,
                      threads: int = 0) -> torch.Tensor:
    """E4M3 weights (with block scales, F32 or E8M0, or none: the caller applies a tensor / row scale)
    dotted with x through kernels/cpu_native.c; the same result as the torch path up to summation order."""
    w = w.contiguous()
    n, k = (w.shape[1], w.shape[0]) if kmajor else (w.shape[0], w.shape[1])
    y = torch.empty(n, dtype=torch.float32)
    e8m0 = scale is not None and scale.dtype == torch.float8_e8m0fnu
    s = None if scale is None else (scale.view(torch.uint8) if e8m0 else scale.float()).contiguous()
    lib.sluice_set_threads(threads or torch.get_num_threads())
    fn = lib.sluice_fp8_kmajor if kmajor else lib.sluice_fp8_nmajor
    fn(w.data_ptr(), s.data_ptr() if s is not None else None, s.stride(0) if s is not None else 0, block, int(e8m0),
       x.contiguous().data_ptr(), n, k, y.data_ptr())
    return y


def bf16_matvec_native(lib, w: torch.Tensor, x: torch.Tensor, kmajor: bool, threads: int = 0) -> torch.Tensor:
    """BF16 weights [N, K] (or re-laid [K, N]) dotted with x [K] fp32 through kernels/cpu_native.c: dense_matvec's
    arithmetic up to summation order."""
    w = w.contiguous()
    n, k = (w.shape[1], w.shape[0]) if kmajor else (w.shape[0], w.shape[1])
    y = torch.empty(n, dtype=torch.float32)
    lib.sluice_set_threads(threads or torch.get_num_threads())
    (lib.sluice_bf16_kmajor if kmajor else lib.sluice_bf16_nmajor)(w.data_ptr(), x.contiguous().data_ptr(), n, k, y.data_ptr())
    return y


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


class _Fp4Call:
    """One FP4 projection through the native kernel, addressed by byte offsets in the block: the same call
    as fp4_matvec_native without building tensor views per call (their Python cost, ~40 us an expert, is
    a tenth of a Nano expert's time on 16 cores)."""

    def __init__(self, lib, fmt: WeightFormat, slots: dict, kmajor: bool, threads: int):
        w, sc = slots[fmt.weight], slots[fmt.scale]
        self.lib, self.kmajor, self.threads = lib, kmajor, threads
        self.fn = lib.sluice_fp4_kmajor if kmajor else lib.sluice_fp4_nmajor
        rows, cols = w.stored_shape
        self.n, self.k2 = (cols, rows) if kmajor else (rows, cols)
        self.w_off, self.s_off, self.s_stride = w.offset, sc.offset, sc.stored_shape[1]
        mx = fmt.kind == "mxfp4"
        self.half, self.e8m0 = (MXFP4_GROUP if mx else NVFP4_GROUP) // 2, int(mx)
        self.s2_off = -1 if mx else slots[fmt.scale2].offset
        self.s2_inv = fmt.scale2_inverted

    def factor(self, base: int) -> float:
        """The projection's second-level scale (NVFP4's weight_scale_2, or its inverse) as the output's factor."""
        if self.s2_off < 0:
            return 1.0
        s2 = ctypes.c_float.from_address(base + self.s2_off).value
        return 1.0 / s2 if self.s2_inv else s2

    def inputs(self, block: torch.Tensor, x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A native call's inputs: the block's address and x's even and odd elements; sets the threads."""
        assert block.is_contiguous() and block.dtype == torch.uint8
        self.lib.sluice_set_threads(self.threads or torch.get_num_threads())
        return block.data_ptr(), x[0::2].contiguous(), x[1::2].contiguous()

    def __call__(self, block: torch.Tensor, x: torch.Tensor, int8: bool = False) -> torch.Tensor:
        base, xe, xo = self.inputs(block, x)
        y = torch.empty(self.n, dtype=torch.float32)
        q = Q8(self.lib, xe, xo, self.half) if int8 else None
        ran = q is not None and q.ok and self.lib.sluice_fp4_q8(base + self.w_off, base + self.s_off, self.s_stride, *q.args(),
                                                                self.n, self.k2, self.half, self.e8m0, int(self.kmajor), y.data_ptr())
        if not ran:
            self.fn(base + self.w_off, base + self.s_off, self.s_stride, xe.data_ptr(), xo.data_ptr(), self.n, self.k2, self.half,
                    self.e8m0, y.data_ptr())
        if self.s2_off >= 0:
            y.mul_(self.factor(base))
        return y


def _relu2_expert_q8(up: _Fp4Call, down: _Fp4Call, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """_relu2_expert with int8 activations (x and relu(up)^2 rounded per scale group, `Q8`): one native call."""
    base, xe, xo = up.inputs(block, x)
    I, Dx = up.n, down.n
    M = max(Dx, I) // 2
    f32 = torch.float32
    h, he, ho, y = torch.empty(I, dtype=f32), torch.empty(I // 2, dtype=f32), torch.empty(I // 2, dtype=f32), torch.empty(Dx, dtype=f32)
    q, xs, c = torch.empty(2 * M, dtype=torch.int8), torch.empty(M // 4 + 1, dtype=f32), torch.empty(M // 4 + 1, dtype=torch.int32)
    up.lib.sluice_fp4_relu2_expert_q8(base + up.w_off, base + up.s_off, up.s_stride, up.factor(base), base + down.w_off,
                                      base + down.s_off, down.s_stride, down.factor(base), xe.data_ptr(), xo.data_ptr(), Dx, I,
                                      up.half, up.e8m0, h.data_ptr(), he.data_ptr(), ho.data_ptr(), y.data_ptr(), q.data_ptr(),
                                      xs.data_ptr(), c.data_ptr())
    return y


def _swiglu_expert(gate: _Fp4Call, up: _Fp4Call, down: _Fp4Call, block: torch.Tensor, x: torch.Tensor, int8: bool) -> torch.Tensor:
    """A SwiGLU FP4 expert with plain SiLU (gate, up, silu(g) * u, down) in one native call, int8 activations or not."""
    base, xe, xo = up.inputs(block, x)
    I, Dx = up.n, down.n
    M = max(Dx, I) // 2
    f32 = torch.float32
    g, u, he, ho, y = (torch.empty(n, dtype=f32) for n in (I, I, I // 2, I // 2, Dx))
    q, xs, c = torch.empty(2 * M, dtype=torch.int8), torch.empty(M // 4 + 1, dtype=f32), torch.empty(M // 4 + 1, dtype=torch.int32)
    args = []
    for p in (gate, up, down):
        args += [base + p.w_off, base + p.s_off, p.s_stride, p.factor(base)]
    up.lib.sluice_fp4_swiglu_expert(*args, xe.data_ptr(), xo.data_ptr(), Dx, I, up.half, up.e8m0, g.data_ptr(), u.data_ptr(),
                                    he.data_ptr(), ho.data_ptr(), y.data_ptr(), q.data_ptr(), xs.data_ptr(), c.data_ptr(), int(int8))
    return y


def _relu2_expert(up: _Fp4Call, down: _Fp4Call, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A ReLU^2 FP4 expert in one native call (up, the activation, the re-laid down): the result of
    up -> relu^2 -> down through _Fp4Call, with the GIL released for all of it."""
    base, xe, xo = up.inputs(block, x)
    I, Dx = up.n, down.n
    f32 = torch.float32
    h, he, ho, y = torch.empty(I, dtype=f32), torch.empty(I // 2, dtype=f32), torch.empty(I // 2, dtype=f32), torch.empty(Dx, dtype=f32)
    up.lib.sluice_fp4_relu2_expert(base + up.w_off, base + up.s_off, up.s_stride, up.factor(base), base + down.w_off, base + down.s_off,
                                   down.s_stride, down.factor(base), xe.data_ptr(), xo.data_ptr(), Dx, I, up.half, up.e8m0,
                                   h.data_ptr(), he.data_ptr(), ho.data_ptr(), y.data_ptr())
    return y


class CpuExperts:
    """A store's experts on the CPU, one token and one expert at a time, from block buffers (uint8 views of
    RAM slots). `act` / `glu` are the MoE block's own (transformers' activation, the model's gated unit).
    threads: the native kernels' OpenMP threads (0: torch's count). act_name "relu2" (with FP4 up and
    re-laid down) lets the native path run the whole expert in one call, as "silu" (plain SiLU, no `glu`) does for a
    SwiGLU FP4 expert."""

    def __init__(self, manifest, kind: str, act: Callable, glu: Callable | None = None, compiled: bool = True,
                 native: bool = True, threads: int = 0, act_name: str = "", int8: bool = False):
        m = manifest
        self.kind, self.act, self.glu, self.compiled, self.native, self.threads = kind, act, glu, compiled, native, threads
        self.formats: dict[str, WeightFormat] = m.formats
        self.slots = {proj: [s for s in m.slots if s.proj == proj] for proj in m.formats}
        self.kmajor = {proj: any(s.relaid and s.suffix == f.weight for s in self.slots[proj]) for proj, f in m.formats.items()}
        self.fp4 = {}  # proj -> _Fp4Call, where the native FP4 kernel takes it straight from the block's bytes
        lib = native_kernels() if native else None
        if lib is not None:
            for proj, f in m.formats.items():
                slots = {s.suffix: s for s in self.slots[proj]}
                if f.kind in ("nvfp4", "mxfp4") and not f.bias and (f.kind == "mxfp4" or slots[f.scale2].dtype == "F32"):
                    self.fp4[proj] = _Fp4Call(lib, f, slots, self.kmajor[proj], threads)
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

    def _proj(self, block: torch.Tensor, proj: str, x: torch.Tensor) -> torch.Tensor:
        if proj in self.fp4:
            return self.fp4[proj](block, x, self.int8)
        t = {s.suffix: s.view(block) for s in self.slots[proj]}
        return proj_matvec(t, self.formats[proj], self.kmajor[proj], x, self.compiled, self.native, self.threads)

    @torch.inference_mode()
    def run(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [Dx] fp32 -> the expert's output [Dx] fp32."""
        if self.fused:
            return (_relu2_expert_q8 if self.int8 else _relu2_expert)(self.fp4["up"], self.fp4["down"], block, x)
        if self.fused_swiglu:
            return _swiglu_expert(self.fp4["gate"], self.fp4["up"], self.fp4["down"], block, x, self.int8)
        if self.kind == "relu2":
            h = self.act(self._proj(block, "up", x))
        else:
            g, u = self._proj(block, "gate", x), self._proj(block, "up", x)
            h = self.glu(g, u) if self.glu is not None else self.act(g) * u
        return self._proj(block, "down", h)
