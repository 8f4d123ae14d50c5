"""The native CPU expert kernels (kernels/cpu_native.c) and their calls from Python, for kernels/cpu.py.

The C file is built once per machine under SLUICE_HOME/build (-O3 -march=native -fopenmp) and called
through ctypes, which releases the GIL; torch.compile's loops keep a short inner reduction per scale group
that does not vectorise well, and its E4M3 decode stays scalar (BENCHMARKS.md). `int8` (AVX-512 VNNI): FP4
projections with x rounded to int8 per scale group and the products summed in int32 (vpdpbusd, 128 weights
an instruction), exact sums of the rounded x (kernels/cpu.py `q8_reference`), ~0.5% off the fp32 result;
opt-in (the compute stage's `cpu_int8`). A ReLU^2 FP4 expert (up, activation, re-laid down) and a SwiGLU one
with plain SiLU each run in one call.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from sluice.kernels.formats import MXFP4_GROUP, NVFP4_GROUP, WeightFormat


_NATIVE: list = []  # [ctypes library or None], once tried
_TLS = threading.local()  # per calling thread: the OpenMP thread count it last set, and reused scratch buffers


def set_threads(lib, threads: int) -> None:
    """The calling thread's OpenMP thread count for the native kernels (0: torch's), set only when it changes."""
    n = threads or torch.get_num_threads()
    if getattr(_TLS, "threads", None) != n:
        lib.sluice_set_threads(n)
        _TLS.threads = n


def scratch(key: tuple, make) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """The calling thread's buffers for `key`, made once by `make()` and reused by every later call with the
    same key (a one-call expert's temporaries: their allocations cost more than a small expert's arithmetic on
    16 cores); returns (tensors, their addresses)."""
    bufs = getattr(_TLS, "bufs", None)
    if bufs is None:
        bufs = _TLS.bufs = {}
    got = bufs.get(key)
    if got is None:
        ts = make()
        got = bufs[key] = (ts, [t.data_ptr() for t in ts])
    return got


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
    set_threads(lib, threads)
    fn = lib.sluice_fp4_kmajor if kmajor else lib.sluice_fp4_nmajor
    fn(p.data_ptr(), s.data_ptr(), s.stride(0), xe.data_ptr(), xo.data_ptr(), n, k2, group // 2, int(e8m0), y.data_ptr())
    return y


class Q8:
    """x's even and odd elements quantized to int8 per FP4 scale group (`half` bytes of the row: 16 or 32 inputs) for
    kernels/cpu_native.c's int8 path (AVX-512 VNNI): qe, qo [K2] int8, xs [K2/4] (each 4-byte quad's group scale / 2),
    corr [K2/4] int32 (-12 * the quad's sum of qe + qo: the kernels' sums start from it, taking back the offset of
    their table)."""

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
    set_threads(lib, threads)
    q = Q8(lib, xe.contiguous(), xo.contiguous(), group // 2)
    ran = q.ok and lib.sluice_fp4_q8(p.data_ptr(), s.data_ptr(), s.stride(0), *q.args(), n, k2, group // 2, int(e8m0), int(kmajor), y.data_ptr())
    return y if ran else None


def fp8_matvec_native(lib, w: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor, block: int, kmajor: bool,
                      threads: int = 0) -> torch.Tensor:
    """E4M3 weights (with block scales, F32 or E8M0, or none: the caller applies a tensor / row scale)
    dotted with x through kernels/cpu_native.c; the same result as the torch path up to summation order."""
    w = w.contiguous()
    n, k = (w.shape[1], w.shape[0]) if kmajor else (w.shape[0], w.shape[1])
    y = torch.empty(n, dtype=torch.float32)
    e8m0 = scale is not None and scale.dtype == torch.float8_e8m0fnu
    s = None if scale is None else (scale.view(torch.uint8) if e8m0 else scale.float()).contiguous()
    set_threads(lib, threads)
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
    set_threads(lib, threads)
    (lib.sluice_bf16_kmajor if kmajor else lib.sluice_bf16_nmajor)(w.data_ptr(), x.contiguous().data_ptr(), n, k, y.data_ptr())
    return y


class Fp4Call:
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
        set_threads(self.lib, self.threads)
        return block.data_ptr(), x[0::2].contiguous(), x[1::2].contiguous()

    def expert_inputs(self, block: torch.Tensor, x: torch.Tensor, sizes: tuple[tuple[int, torch.dtype], ...]) -> tuple[int, int, int, list[int]]:
        """A one-call expert's inputs (this projection takes x): the block's address, x's even and odd elements'
        addresses, and scratch buffers of `sizes` ((numel, dtype) each), all in the calling thread's reused buffers."""
        assert block.is_contiguous() and block.dtype == torch.uint8
        set_threads(self.lib, self.threads)
        k2 = self.k2
        (xeo, *_), ptrs = scratch((id(self), k2, sizes), lambda: (torch.empty(2, k2), *(torch.empty(n, dtype=d) for n, d in sizes)))
        xeo.copy_(x.view(k2, 2).t())
        return block.data_ptr(), ptrs[0], ptrs[0] + 4 * k2, ptrs[1:]

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


def relu2_expert_q8(up: Fp4Call, down: Fp4Call, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """relu2_expert with int8 activations (x and relu(up)^2 rounded per scale group, `Q8`): one native call."""
    I, Dx = up.n, down.n
    M = max(Dx, I) // 2
    f32 = torch.float32
    base, xe, xo, (h, he, ho, q, xs, c) = up.expert_inputs(block, x, ((I, f32), (I // 2, f32), (I // 2, f32), (2 * M, torch.int8),
                                                                   (M // 4 + 1, f32), (M // 4 + 1, torch.int32)))
    y = torch.empty(Dx, dtype=f32)
    up.lib.sluice_fp4_relu2_expert_q8(base + up.w_off, base + up.s_off, up.s_stride, up.factor(base), base + down.w_off,
                                      base + down.s_off, down.s_stride, down.factor(base), xe, xo, Dx, I, up.half, up.e8m0, h, he, ho,
                                      y.data_ptr(), q, xs, c)
    return y


def swiglu_expert(gate: Fp4Call, up: Fp4Call, down: Fp4Call, block: torch.Tensor, x: torch.Tensor, int8: bool) -> torch.Tensor:
    """A SwiGLU FP4 expert with plain SiLU (gate, up, silu(g) * u, down) in one native call, int8 activations or not."""
    I, Dx = up.n, down.n
    M = max(Dx, I) // 2
    f32 = torch.float32
    base, xe, xo, (g, u, he, ho, q, xs, c) = up.expert_inputs(block, x, ((I, f32), (I, f32), (I // 2, f32), (I // 2, f32),
                                                                      (2 * M, torch.int8), (M // 4 + 1, f32), (M // 4 + 1, torch.int32)))
    y = torch.empty(Dx, dtype=f32)
    args = []
    for p in (gate, up, down):
        args += [base + p.w_off, base + p.s_off, p.s_stride, p.factor(base)]
    up.lib.sluice_fp4_swiglu_expert(*args, xe, xo, Dx, I, up.half, up.e8m0, g, u, he, ho, y.data_ptr(), q, xs, c, int(int8))
    return y


def relu2_expert(up: Fp4Call, down: Fp4Call, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A ReLU^2 FP4 expert in one native call (up, the activation, the re-laid down): the result of
    up -> relu^2 -> down through Fp4Call, with the GIL released for all of it."""
    I, Dx = up.n, down.n
    f32 = torch.float32
    base, xe, xo, (h, he, ho) = up.expert_inputs(block, x, ((I, f32), (I // 2, f32), (I // 2, f32)))
    y = torch.empty(Dx, dtype=f32)
    up.lib.sluice_fp4_relu2_expert(base + up.w_off, base + up.s_off, up.s_stride, up.factor(base), base + down.w_off, base + down.s_off,
                                   down.s_stride, down.factor(base), xe, xo, Dx, I, up.half, up.e8m0, h, he, ho, y.data_ptr())
    return y
