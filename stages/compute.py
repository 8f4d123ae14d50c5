"""compute: the routed experts of each arriving batch of blocks, weighted, into per-(token, k) rows.

Each expert's output for the rows it serves is multiplied by the routing weight and written to
its own rows of y [T*K, Dx]: no accumulation here, so the result does not depend on how blocks
were batched or in which order they arrived (combine sums in a fixed order). The compute stream
waits for each block's copy event; the blocks are released with the event recorded after the
batch, so their slots are not refilled before the kernels have read them.

Backends: `triton` (kernels/experts.py: one launch per projection for the whole batch; on a CPU
only under TRITON_INTERPRET=1), `torch` (kernels/experts_ref.py: the plain-torch reference, one
expert at a time), `auto` (triton on CUDA, torch on a CPU). `zero_skip` makes the ReLU^2 down
kernel skip 16-neuron groups whose activations are all zero; `graphs` replays one-token batches
as CUDA graphs (kernels/experts.py), cutting the host's launch cost.

Blocks h2d left to the CPU (the hybrid miss path, `on_cpu`) run on a worker thread through the CPU
kernels (kernels/cpu.py, compiled by torch.compile unless `cpu_compile` is off; the native ones on
`cpu_threads` threads, by default all cores but two, which stay with the event loop and the readers)
while the GPU runs the rest. Their outputs come back through pinned memory (a copy from pageable
memory would first wait for everything queued on the stream), are weighted on the device and written
to their own rows of y like any other expert's, so combine's fixed order holds. Each CPU block's time
feeds the runtime's measured rate (kernels/rates.py `CpuRate`; h2d's `cpu_balance`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sluice.errors import ScheduleError
from sluice.kernels import triton_runs_on
from sluice.kernels.experts_ref import dequant_expert_ref, expert_ref
from sluice.stages.base import Stage, StageIO
from sluice.stages.route import OneTokenRows
from sluice.stages.types import DeviceBlock, ExpertOutputs, LayerInput, Routing


GIL_SWITCH_S = 0.0002  # Python's GIL switch interval while a hybrid path's CPU worker runs
_gil = {"users": 0, "saved": 0.0}
_gil_lock = threading.Lock()


def _short_gil_switch(delta: int) -> None:
    """Count CPU workers (of every engine in the process) in (+1) and out (-1): the first one shortens
    Python's switch interval, the last one puts Python's own back."""
    with _gil_lock:
        if delta > 0 and _gil["users"] == 0:
            _gil["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_gil["saved"], GIL_SWITCH_S))
        _gil["users"] += delta
        if delta < 0 and _gil["users"] == 0:
            sys.setswitchinterval(_gil["saved"])


@dataclass(frozen=True)
class ComputeKnobs:
    backend: str = "auto"  # auto | triton | torch
    zero_skip: bool = False  # ReLU^2 down reads only live 16-neuron groups (triton backend)
    graphs: bool = True  # one-token batches replay a CUDA graph of the expert kernels (triton backend on CUDA)
    cpu_compile: bool = True  # the hybrid path's CPU kernels through torch.compile (else eager torch ops)
    cpu_threads: int = 0  # the hybrid path's native CPU kernels' threads; 0: all cores but two (the host's own work)
    cpu_int8: bool = False  # the hybrid path's FP4 experts with activations rounded to int8 per scale group (AVX-512 VNNI;
    # faster ReLU^2 experts, each output ~0.5% off the fp32 kernels': kernels/cpu_native.py)
    fp4_matvec: str = "auto"  # one-token NVFP4 / FP8 formulation: f16x2 | words | auto (fp4_formulation)


def cpu_experts(cache: dict, rt, block, threads: int, compiled: bool, int8: bool):
    """The CPU expert kernels (kernels/cpu.py CpuExperts) for `block`'s kind and activation, made once into `cache`;
    threads: the native kernels' OpenMP threads (0: all cores but two, which stay with the event loop and the readers)."""
    key = (block.kind, block.act_name)
    if key not in cache:
        from sluice.kernels.cpu import CpuExperts

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cache[key] = CpuExperts(rt.store.manifest, block.kind, block.act, block.glu, compiled, threads=threads or max(1, cores - 2),
                                act_name=block.act_name, int8=int8)
    return cache[key]


def expert_backend(stage: str, backend: str, device: torch.device) -> str:
    """A stage's `backend` knob resolved: auto is triton on CUDA, torch on a CPU; triton off CUDA needs the interpreter."""
    if backend not in ("auto", "triton", "torch"):
        raise ScheduleError(f"stage {stage!r}: 'backend' must be auto, triton or torch, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and not triton_runs_on(device):
        raise ScheduleError(f"stage {stage!r}: the triton backend needs CUDA (or TRITON_INTERPRET=1 on a CPU)")
    return backend


FP4_MATVECS = ("auto", "f16x2", "words")


def check_fp4_matvec(stage: str, value: str) -> None:
    if value not in FP4_MATVECS:
        raise ScheduleError(f"stage {stage!r}: 'fp4_matvec' must be one of {', '.join(FP4_MATVECS)}, got {value!r}")


def fp4_formulation(choice: str, kind: str, device: torch.device, fp8: bool = False) -> str:
    """The one-token formulation a stage's `fp4_matvec` knob gives: `words` (NVFP4 as 32-bit words of eight nibbles,
    each decoded to fp32 in software) or `f16x2` (nibbles widened to e4m3 bytes, `cvt.rn.f16x2.e4m3x2`, f16x2 FMAs;
    fp16 products; for ReLU^2 experts also the re-laid down in f16x2, NVFP4 or FP8). `auto` takes f16x2 where its
    kernels timed faster or the same (`sluice bench kernels`; figures in docs/benchmarks/): ReLU^2 experts and FP8
    experts of any kind, not NVFP4 SwiGLU. Only on a GPU with the e4m3 conversion (compute capability 8.9 on), else
    words."""
    e4m3 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if choice == "f16x2" and device.type == "cuda" and not e4m3:
        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ScheduleError(f"'fp4_matvec: f16x2' needs a GPU of compute capability 8.9 or newer (its e4m3 conversion); "
                            f"this one is {cc}: use 'words' or 'auto'")
    if choice != "auto":
        return choice
    return "f16x2" if e4m3 and (kind == "relu2" or fp8) else "words"


def triton_experts(made: dict, rt, block, graphs: bool, fp4_matvec: str = "auto"):
    """The TritonExperts for `block`'s kind and activation, made once per stage (`made`) and counted by rt.stats;
    `fp4_matvec`: the one-token NVFP4 formulation (`fp4_formulation`; f16x2 is matvec's fp4_words 3)."""
    from sluice.kernels.decode import FP4_WORDS
    from sluice.kernels.experts import TritonExperts

    kern = made.get((block.kind, block.act_name))
    if kern is None:
        fp8 = rt.store.manifest.formats["up"].kind.startswith("fp8")
        words = 3 if fp4_formulation(fp4_matvec, block.kind, rt.device, fp8) == "f16x2" else FP4_WORDS
        kern = made[(block.kind, block.act_name)] = TritonExperts(rt.store.manifest, block.kind, block.act_name, rt.device,
                                                                 block.act_args, graphs, words, rt.pools)
        rt.stats.kernels.append(kern)
    return kern


def torch_expert(store, block, views: dict, rows: torch.Tensor, xe: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """One expert (its block's tensors `views`) on its flat (token, k) rows through the plain-torch reference,
    weighted, into y's rows. Views in host memory (the table schedules' RAM slots) are dequantised there and brought
    to xe's device."""
    dense = {k: t.to(xe.device) for k, t in dequant_expert_ref(store.manifest.formats, views, xe.dtype).items()}
    out = expert_ref(block.kind, xe[rows // block.top_k], dense, block.act, block.glu)
    y[rows] = (out * w[rows, None]).to(block.combine_dtype)


class Compute(Stage):
    name = "compute"
    consumes = ("layer", "routing", "device_blocks")
    produces = "expert_outputs"
    Knobs = ComputeKnobs

    def __init__(self, knobs, stream, rt):
        super().__init__(knobs, stream, rt)
        self.backend = expert_backend(self.name, knobs.backend, rt.device)
        check_fp4_matvec(self.name, knobs.fp4_matvec)
        self._kernels = {}  # (kind, act) -> TritonExperts
        self._cpu = {}  # (kind, act) -> CpuExperts
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, io: StageIO) -> ExpertOutputs:
        li: LayerInput = await io.value("layer")
        r: Routing = await io.value("routing")
        streams = self.rt.streams
        T, K = r.ids.shape
        y = torch.empty(T * K, r.xe.shape[1], dtype=li.block.combine_dtype, device=r.xe.device)
        w = r.weights.reshape(-1)
        on_cpu: list[tuple[list[DeviceBlock], asyncio.Future]] = []
        xe_cpu = None
        async for batch in io.batches("device_blocks"):
            cpu_dbs = [db for db in batch if db.on_cpu]
            if cpu_dbs and xe_cpu is None:
                xe_cpu = r.xe.float().cpu()  # ready: route's sync came after it
            # one token: the batch's CPU blocks in one call; a prompt: each block on the tokens routed to it
            groups = [cpu_dbs] if cpu_dbs and T == 1 else [[db] for db in cpu_dbs]
            for dbs in groups:
                x = xe_cpu if T == 1 else xe_cpu[(r.ids == dbs[0].expert).nonzero()[:, 0]]  # ascending, as r.rows[expert]
                fut = asyncio.get_running_loop().run_in_executor(self._cpu_pool(), self._cpu_blocks, li, dbs, x)
                # the RAM slots go back as soon as the CPU is done with them: fetch may be waiting for a slot
                # to bring the layer's remaining blocks through a small cache
                fut.add_done_callback(lambda f, dbs=dbs: [db.release(None) for db in dbs])
                on_cpu.append((dbs, fut))
            batch = [db for db in batch if not db.on_cpu]
            if not batch:
                continue
            with streams.use(self.stream):
                for db in batch:
                    streams.wait(self.stream, db.ready)
                if self.backend == "triton":
                    self._triton(li, r, batch, w, y)
                else:
                    self._torch(li, r, batch, w, y)
                done = streams.record(self.stream)
            for db in batch:
                db.release(done)
        for dbs, fut in on_cpu:
            outs = await fut
            self.rt.stats.cpu_blocks += len(dbs)
            for db, out in zip(dbs, outs):
                rows = r.rows[db.expert]
                with streams.use(self.stream):
                    y[rows] = (out.to(y.device, non_blocking=True) * w[rows, None]).to(li.block.combine_dtype)
        return ExpertOutputs(y)

    def _cpu_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-cpu-experts")
            # the worker takes the GIL back between its kernel calls while the event loop's thread, busy
            # launching the GPU's work, holds it: Python's default 5 ms switch interval starves it
            _short_gil_switch(+1)
        return self._pool

    def _cpu_blocks(self, li: LayerInput, dbs: list[DeviceBlock], x: torch.Tensor) -> torch.Tensor:
        """Experts on the CPU, from their RAM slots (a worker thread): x [n, Dx] fp32, the tokens routed to them (one
        token for several blocks; several for one block, token by token) -> [blocks, n, Dx] fp32."""
        block, rt = li.block, self.rt
        first = (block.kind, block.act_name) not in self._cpu
        experts = cpu_experts(self._cpu, rt, block, self.knobs.cpu_threads, self.knobs.cpu_compile, self.knobs.cpu_int8)
        t = time.perf_counter()
        views = [db.bank.narrow(0, db.offset, rt.store.block_bytes) for db in dbs]
        if len(dbs) > 1:  # one token through every block
            out = experts.run_many(views, x[0])[:, None]
        else:
            out = torch.stack([experts.run(views[0], row) for row in x])[None]
        if rt.device.type == "cuda":  # pinned: the copy to the GPU then waits for nothing queued before it
            out = out.pin_memory()
        if not first:  # the first call compiles the kernels: not a rate
            rt.cpu_rate.observe(x.shape[0] * len(dbs), time.perf_counter() - t)  # a block and token each count one
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            _short_gil_switch(-1)

    def _torch(self, li: LayerInput, r: Routing, batch: list[DeviceBlock], w: torch.Tensor, y: torch.Tensor) -> None:
        store = self.rt.store
        for db in batch:
            views = store.logical(db.bank.narrow(0, db.offset, store.block_bytes))
            if db.down_bank is not db.bank:
                views["down"] = store.logical(db.down_bank.narrow(0, db.down_offset, store.block_bytes))["down"]
            torch_expert(store, li.block, views, r.rows[db.expert], r.xe, w, y)

    def _triton(self, li: LayerInput, r: Routing, batch: list[DeviceBlock], w: torch.Tensor, y: torch.Tensor) -> None:
        block = li.block
        kern = triton_experts(self._kernels, self.rt, block, self.knobs.graphs, self.knobs.fp4_matvec)
        if isinstance(r.rows, OneTokenRows) and len({db.bank.data_ptr() for db in batch}) == 1 \
                and len({db.down_bank.data_ptr() for db in batch}) == 1:  # a decode step: offsets and positions as ints
            pos = r.rows.positions
            kern.run_token(batch[0].bank, [db.offset for db in batch], batch[0].down_bank, [db.down_offset for db in batch],
                           [pos[db.expert] for db in batch], r.xe[0], w, y, self.knobs.zero_skip)
            return
        dev = y.device
        offs = torch.tensor([db.offset for db in batch], dtype=torch.int64).to(dev, non_blocking=True)
        down_offs = torch.tensor([db.down_offset for db in batch], dtype=torch.int64).to(dev, non_blocking=True)
        rows = [r.rows[db.expert] for db in batch]
        kern.run(batch[0].bank, offs, batch[0].down_bank, down_offs, [x.numel() for x in rows], torch.cat(rows),
                 r.ids.shape[1], r.xe, w, y, self.knobs.zero_skip)
