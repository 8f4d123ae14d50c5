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
_TLS = threading.local()  # per calling thread: the OpenMP thread count it last set


def set_threads(lib, threads: int) -> None:
    """The calling thread's OpenMP thread count for the native kernels (0: torch's), set only when it changes."""
    n = threads or torch.get_num_threads()
    if getattr(_TLS, "threads", None) != n:
        lib.sluice_set_threads(n)
        _TLS.threads = n


def native_kernels():
    """The C FP4 / FP8 kernels (kernels/cpu_native.c) for this machine, built on first use; None without a compiler."""
    if _NATIVE:
        return _NATIVE[0]
    from sluice.log import get_logger
    from sluice.storage.home import sluice_home

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
        parts = [src, *sorted(src.with_name("native").glob("*.[ch]"))]  # the unit and the parts it includes
        key = hashlib.sha256(b"".join(p.read_bytes() for p in parts) + " ".join([cc, *flags, cpu]).encode()).hexdigest()[:16]
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
            ptr, long_ = ctypes.c_void_p, ctypes.c_long
            lib.sluice_q8_prep.argtypes = [ptr, ptr, long_, ctypes.c_int, ptr, ptr, ptr, ptr]
            lib.sluice_q8_prep.restype = ctypes.c_int
            lib.sluice_fp4_q8.argtypes = [ptr, ptr, long_, ptr, ptr, ptr, ptr, long_, long_, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int, ptr]
            lib.sluice_fp4_q8.restype = ctypes.c_int
            lib.sluice_q8_available.restype = ctypes.c_int
            for fn in (lib.sluice_bf16_nmajor, lib.sluice_bf16_kmajor):
                fn.argtypes, fn.restype = [ptr, ptr, long_, long_, ptr], None
            lib.sluice_set_threads.argtypes = [ctypes.c_int]
            lib.sluice_experts.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr]
            lib.sluice_experts.restype = ctypes.c_int
            lib.sluice_experts_rows.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int]
            lib.sluice_experts_rows.restype = ctypes.c_int
            lib.sluice_experts_pairs.argtypes = lib.sluice_experts_rows.argtypes
            lib.sluice_experts_pairs.restype = ctypes.c_int
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


class ExpertPlan:
    """A layout's experts described once as kernels/cpu_native.c's plan, so that n blocks of it run for one token in one
    call (sluice_experts: the whole layer in one parallel region, x split, scratch and each block's scales on the C side,
    a few microseconds of Python a call): FP4 ones (`fp4`: a ReLU^2 expert with n-major up and re-laid down, or a
    SwiGLU one with plain SiLU and gate, up, down n-major; fp32 or int8 activations) and BF16 / FP8 ones (`dense`)."""

    def __init__(self, lib, fields: list[int], dx: int, threads: int):
        self.plan = (ctypes.c_int64 * len(fields))(*fields)
        self.lib, self.dx, self.threads = lib, dx, threads
        self._scratch: torch.Tensor | None = None  # `rows`' fp32 outputs before their rounding, reused call to call

    @classmethod
    def fp4(cls, lib, kind: str, up: Fp4Call, down: Fp4Call, gate: Fp4Call | None, int8: bool) -> "ExpertPlan":
        f = [0 if kind == "relu2" else 1, int(int8), down.n, up.n, up.half, up.e8m0]
        for p in (up, down, gate):
            f += [p.w_off, p.s_off, p.s_stride, p.s2_off, int(p.s2_inv)] if p is not None else [0, 0, 0, -1, 0]
        return cls(lib, f, down.n, up.threads)

    @classmethod
    def dense(cls, lib, kind: str, formats: dict[str, WeightFormat], slots: dict[str, list], kmajor: dict[str, bool],
              threads: int) -> "ExpertPlan | None":
        """BF16 / FP8 projections (one F32 scale for the tensor or per output, or F32 / E8M0 scales per tile), with no
        bias and one orientation per projection; None for anything else."""
        projs = ("up", "down") if kind == "relu2" else ("up", "down", "gate")
        fields, dims = [], {}
        for proj in projs:
            f, by = formats.get(proj), {s.suffix: s for s in slots.get(proj, [])}
            if f is None or f.bias or f.kind not in ("dense", "fp8", "fp8_block"):
                return None
            w = by[f.weight]
            if w.dtype not in ("BF16", "F8_E4M3") or (w.dtype == "BF16") != (f.kind == "dense") or len(w.shape) != 2:
                return None
            n_out, k_in = w.shape  # the checkpoint's [out, in]
            skind, s_off, s_stride = 0, 0, 0
            if f.kind != "dense":
                sc = by[f.scale]
                if f.kind == "fp8":
                    if sc.dtype != "F32" or sc.nbytes // 4 not in (1, n_out):
                        return None
                    skind = 1 if sc.nbytes == 4 else 2
                else:
                    if sc.dtype not in ("F32", "F8_E8M0") or len(sc.shape) != 2 or f.block <= 0:
                        return None
                    skind, s_stride = (3 if sc.dtype == "F32" else 4), sc.stored_shape[1]
                s_off = sc.offset
            dims[proj] = (n_out, k_in)
            fields += [w.offset, 1 if w.dtype == "BF16" else 2, int(kmajor[proj]), skind, s_off, s_stride, f.block]
        I, Dx = dims["up"]
        if dims["down"] != (Dx, I) or dims.get("gate", (I, Dx)) != (I, Dx):
            return None
        head = [2 if kind == "relu2" else 3, 0, Dx, I, 0, 0]
        return cls(lib, head + fields, Dx, threads)

    def __call__(self, blocks: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """blocks: n uint8 block buffers (contiguous); x [Dx] fp32 -> [n, Dx] fp32."""
        assert all(b.dtype == torch.uint8 and b.is_contiguous() for b in blocks)
        set_threads(self.lib, self.threads)
        n = len(blocks)
        x = x.float().contiguous()
        y = torch.empty(n, self.dx, dtype=torch.float32)
        self._check(self.lib.sluice_experts(self.plan, n, _addresses(blocks), x.data_ptr(), y.data_ptr()))
        return y

    def rows(self, blocks: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, round_bf16: bool, out: torch.Tensor,
             rows: list[int]) -> None:
        """`__call__`'s outputs, each rounded to bf16 (round_bf16) or not and times its weight w [n] fp32, written to
        out's `rows` (out [K, Dx] fp32 or bf16, contiguous) in the same native call: a MoE layer's host rows with no
        torch op (a few of them on [n, Dx] cost ~70 us of dispatch a layer)."""
        self._weighed(self.lib.sluice_experts_rows, len(blocks), blocks, x, w, round_bf16, out, rows)

    def pairs(self, blocks: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, round_bf16: bool, out: torch.Tensor,
              rows: list[int]) -> None:
        """`rows` with an input a block: x [n, Dx] fp32 (contiguous), pair e block e on x[e]; a block's pairs side by side
        read it from RAM once (sluice_experts_pairs: scratch for up to 4 of a block's rows at a time, its ROWS)."""
        self._weighed(self.lib.sluice_experts_pairs, 4, blocks, x, w, round_bf16, out, rows)

    def _weighed(self, fn, scratch_rows: int, blocks: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor,
                 round_bf16: bool, out: torch.Tensor, rows: list[int]) -> None:
        """One native call of `rows`' or `pairs`' kind, its fp32 scratch at least `scratch_rows` (and 8) rows."""
        set_threads(self.lib, self.threads)
        n = len(blocks)
        if self._scratch is None or self._scratch.shape[0] < scratch_rows:
            self._scratch = torch.empty(max(scratch_rows, 8), self.dx, dtype=torch.float32)
        self._check(fn(self.plan, n, _addresses(blocks), x.data_ptr(), self._scratch.data_ptr(), w.data_ptr(),
                       (ctypes.c_int64 * n)(*rows), int(round_bf16), out.data_ptr(), int(out.dtype == torch.bfloat16)))

    @staticmethod
    def _check(done: int) -> None:
        if not done:
            raise RuntimeError("sluice_experts: a plan the native library does not know")


def _addresses(blocks: list[torch.Tensor]):
    """The blocks' addresses as the C side's int64 array."""
    return (ctypes.c_int64 * len(blocks))(*[b.data_ptr() for b in blocks])
