"""`sluice bench kernels`: achieved bandwidth of each expert kernel against ceilings measured in the same run.

"bytes alone" rows: a kernel that only reads as many bytes from each of the same blocks (no arithmetic, its best of a
few tile sizes) as the up projection holds: how much of the HBM ceiling a launch of that size can reach at all.

Ceilings: HBM (a large device-to-device copy, bytes read + written) and pinned host-to-device
(a large copy). Each kernel moves the bytes of the blocks it reads; those over its median time
(a CUDA graph of 20 calls, as decode runs them; or do_bench per launch) is its achieved GB/s.
Banks rotate through more memory than the L2 holds,
so repeated launches do not measure the cache. Zero-copy down reads live 16-neuron groups from
pinned host memory; its bytes are the live groups' bytes, compared with the host-to-device ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.kernels.formats import detect_format, random_weight
from sluice.kernels.layout import proj_layouts
from sluice.storage.safetensors_io import TORCH_TO_ST
from sluice.storage.store import pack_block, plan_layout

# model shapes: expert kind, Dx (expert input), I (intermediate), A (experts per token)
SHAPES = {
    "super": ("relu2", 1024, 2688, 22),  # Nemotron-3.5-Super: latent 1024, 512 experts top-22
    "nano": ("relu2", 2688, 1856, 6),  # NVIDIA-Nemotron-3-Nano-30B-A3B
    "qwen3-30b": ("swiglu", 2048, 768, 8),  # Qwen3-30B-A3B
    "gpt-oss-120b": ("swiglu", 2880, 2880, 4),  # gpt-oss-120b: 128 experts top-4
}
FORMATS = ("nvfp4", "mxfp4", "fp8", "bf16")
L2_BYTES = 64 << 20


@dataclass
class Row:
    kernel: str
    shape: str
    fmt: str
    mbytes: float
    us: float
    gbps: float
    ceiling: str
    pct: float


def expert_layout(kind: str, fmt: str, Dx: int, I: int, device):
    """One expert's random tensors (slot name -> tensor) and the store's block layout for them."""
    projs = ("up", "down") if kind == "relu2" else ("gate", "up", "down")
    g = torch.Generator(device=device).manual_seed(0)
    tensors, entries, formats = {}, [], {}
    for p in projs:
        shape = (Dx, I) if p == "down" else (I, Dx)
        t = random_weight(shape, fmt, device, g)
        formats[p] = detect_format({s: (TORCH_TO_ST[v.dtype], tuple(v.shape)) for s, v in t.items()}, p)
        for sfx, v in t.items():
            tensors[f"{p}.{sfx}"] = v
            entries.append((p, sfx, tuple(v.shape), TORCH_TO_ST[v.dtype], v.numel() * v.element_size(), p == "down" and kind == "relu2" and v.dim() == 2))
    slots, block_bytes = plan_layout(entries)
    return tensors, slots, formats, block_bytes


def make_banks(kind, fmt, Dx, I, A, device, pin=False, min_bytes=3 * L2_BYTES):
    tensors, slots, formats, block_bytes = expert_layout(kind, fmt, Dx, I, device)
    block = pack_block(slots, tensors, torch.zeros(block_bytes, dtype=torch.uint8, device=device))
    copies = max(2, math.ceil(min_bytes / (A * block_bytes)))
    banks = []
    for _ in range(copies):
        b = block.repeat(A)
        banks.append(b.cpu().pin_memory() if pin else b)
    return banks, proj_layouts(formats, slots), block_bytes


def ceilings(device) -> dict[str, float]:
    from triton.testing import do_bench

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    hbm = 2 * n / (do_bench(lambda: b.copy_(a), return_mode="median") * 1e-3) / 1e9
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    h2d = n / (do_bench(lambda: b.copy_(host, non_blocking=True), return_mode="median") * 1e-3) / 1e9
    return {"hbm": hbm, "h2d": h2d}


@dataclass
class _Setup:
    """What a decode benchmark of one shape and format needs."""

    banks: list
    L: dict
    offs: torch.Tensor
    x: torch.Tensor  # [Dx] bf16 token
    h: torch.Tensor  # [A, I] bf16 activations (output of up)
    up_bytes: int  # bytes of up (and gate) for all A experts
    epi: str
    gate: object
    act: int


def _decode_setup(kind: str, fmt: str, Dx: int, I: int, A: int, device) -> _Setup:
    banks, L, block_bytes = make_banks(kind, fmt, Dx, I, A, device)
    offs = torch.arange(A, dtype=torch.int64, device=device) * block_bytes
    x = torch.randn(Dx, device=device, dtype=torch.bfloat16)
    h = torch.empty(A, I, device=device, dtype=torch.bfloat16)
    up_bytes = A * (L["up"].nbytes + (L["gate"].nbytes if "gate" in L else 0))
    epi, gate, act = ("relu2", None, 0) if kind == "relu2" else ("swiglu", L["gate"], 1)
    return _Setup(banks, L, offs, x, h, up_bytes, epi, gate, act)


@triton.jit
def _read_kernel(bank, offs, out, NW, BW: tl.constexpr):
    """The first NW int64 words of block a (grid (A, cdiv(NW, BW))), BW a program: their xor stored, nothing else."""
    a = tl.program_id(0)
    base = (bank + tl.multiple_of(tl.load(offs + a), 16)).to(tl.pointer_type(tl.int64))
    w = tl.program_id(1) * BW + tl.arange(0, BW)
    v = tl.load(base + w, mask=w < NW, other=0)
    tl.store(out + a * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(v, axis=0))


READ_CONFIGS = ((512, 4), (1024, 4), (2048, 8), (4096, 8))  # (int64 words a program, warps)


def read_bytes(bank: torch.Tensor, offs: torch.Tensor, nbytes: int, bw: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Read the first nbytes (a multiple of 8) of each block at offs; the xor of each program's words [A, programs]."""
    nw = nbytes // 8
    out = torch.empty(offs.numel(), triton.cdiv(nw, bw), dtype=torch.int64, device=bank.device)
    _read_kernel[(offs.numel(), out.shape[1])](bank, offs, out, nw, BW=bw, num_warps=num_warps)
    return out


GRAPH_CALLS = 20  # calls per captured graph


def time_calls(fns) -> float:
    """Median microseconds of one call, rotating through fns (one per bank).

    As decode runs them: GRAPH_CALLS calls captured in one CUDA graph and replayed, so the time is
    the kernels' own and not the host's launch cost (which in-graph decode does not pay). With
    TIMING = "launch": triton's do_bench, one launch (and its overhead) per timing."""
    if TIMING == "launch":
        from triton.testing import do_bench

        i = [0]

        def step():
            fns[i[0] % len(fns)]()
            i[0] += 1

        return do_bench(step, return_mode="median") * 1000
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm every variant outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / GRAPH_CALLS)
    del graph
    return sorted(times)[len(times) // 2]


TIMING = "graph"  # or "launch" (set by `sluice bench kernels --launch-timing`)


def bench(shapes=tuple(SHAPES), formats=FORMATS, live_fraction=0.25, device="cuda") -> tuple[dict, list[Row]]:
    from sluice.kernels.decode import matvec
    from sluice.kernels.down import down_relaid, h_pairs

    device = torch.device(device)
    ceil = ceilings(device)
    rows: list[Row] = []

    def add(kernel, shape, fmt, nbytes, us, ceiling):
        gbps = nbytes / (us * 1e-6) / 1e9
        rows.append(Row(kernel, shape, fmt, nbytes / 1e6, us, gbps, ceiling, 100 * gbps / ceil[ceiling]))

    for shape in shapes:
        kind, Dx, I, A = SHAPES[shape]
        for fmt in formats:
            su = _decode_setup(kind, fmt, Dx, I, A, device)
            banks, L, offs, x, h, up_bytes = su.banks, su.L, su.offs, su.x, su.h, su.up_bytes
            per_expert = up_bytes // A // 8 * 8
            us = min(time_calls([lambda b=b: read_bytes(b, offs, per_expert, bw, nw) for b in banks]) for bw, nw in READ_CONFIGS)
            add("bytes alone (up's, read only)", shape, fmt, A * per_expert, us, "hbm")
            if kind == "relu2":
                us = time_calls([lambda b=b: matvec(b, offs, x, L["up"], "relu2", torch.bfloat16, h) for b in banks])
                add("decode up (relu2)", shape, fmt, up_bytes, us, "hbm")
                f16x2, fp8 = fmt in ("nvfp4", "fp8"), fmt == "fp8"
                if f16x2:  # the e4m3 / f16x2 formulation as decode runs it: x packed first, h's pairs written
                    pairs = (torch.empty(A, I // 2, dtype=torch.int32, device=device), torch.empty(A, I // 16, device=device))
                    us = time_calls([lambda b=b: matvec(b, offs, x, L["up"], "relu2", torch.bfloat16, h, fp4_words=3, pairs=pairs,
                                                   pairs_fp8=fp8) for b in banks])
                    add("decode up (relu2, f16x2)", shape, fmt, up_bytes, us, "hbm")
                hl = torch.relu(torch.randn(A, I, device=device)).to(torch.bfloat16)
                us = time_calls([lambda b=b: down_relaid(b, offs, hl, L["down"], skip=False) for b in banks])
                add("decode down (re-laid)", shape, fmt, A * L["down"].nbytes, us, "hbm")
                if f16x2:  # f16x2 products from the pairs the up projection wrote
                    hp = h_pairs(hl, fp8)
                    us = time_calls([lambda b=b: down_relaid(b, offs, hl, L["down"], skip=False, f16x2=True, pairs=hp) for b in banks])
                    add("decode down (re-laid, f16x2)", shape, fmt, A * L["down"].nbytes, us, "hbm")

                    def expert(b):  # both projections as TritonExperts._decode runs them (the down reads every group)
                        matvec(b, offs, x, L["up"], "relu2", torch.bfloat16, h, fp4_words=3, pairs=pairs, pairs_fp8=fp8)
                        down_relaid(b, offs, h, L["down"], skip=False, f16x2=True, pairs=pairs)

                    us = time_calls([lambda b=b: expert(b) for b in banks])
                    add("decode up + down (f16x2)", shape, fmt, up_bytes + A * L["down"].nbytes, us, "hbm")
            else:
                us = time_calls([lambda b=b: matvec(b, offs, x, L["up"], "swiglu", torch.bfloat16, h, gate=L["gate"], act=1) for b in banks])
                add("decode gate+up (swiglu)", shape, fmt, up_bytes, us, "hbm")
                if fmt in ("nvfp4", "fp8"):
                    us = time_calls([lambda b=b: matvec(b, offs, x, L["up"], "swiglu", torch.bfloat16, h, gate=L["gate"], act=1, fp4_words=3)
                                for b in banks])
                    add("decode gate+up (swiglu, f16x2)", shape, fmt, up_bytes, us, "hbm")
                y = torch.empty(A, Dx, device=device, dtype=torch.float32)
                rws = torch.arange(A, device=device)
                wts = torch.rand(A, device=device)
                us = time_calls([lambda b=b: matvec(b, offs, h, L["down"], "weighted", torch.bfloat16, y, rows=rws, wts=wts) for b in banks])
                add("decode down (swiglu)", shape, fmt, A * L["down"].nbytes, us, "hbm")
                if fmt == "fp8":
                    us = time_calls([lambda b=b: matvec(b, offs, h, L["down"], "weighted", torch.bfloat16, y, rows=rws, wts=wts, fp4_words=3)
                                for b in banks])
                    add("decode down (swiglu, f16x2)", shape, fmt, A * L["down"].nbytes, us, "hbm")
            del banks
            if kind == "relu2":
                hbanks, L, block_bytes = make_banks(kind, fmt, Dx, I, A, device, pin=True)
                groups = I // 16
                live = torch.rand(A, groups, device=device) < live_fraction
                hz = (torch.relu(torch.randn(A, groups, 16, device=device)) + 0.1) * live[..., None]
                hz = hz.reshape(A, I).to(torch.bfloat16)
                n_live = int(live.sum())
                group_bytes = L["down"].nbytes / groups
                us = time_calls([lambda b=b: down_relaid(b, offs, hz, L["down"], skip=True) for b in hbanks])
                add(f"zero-copy down, {live_fraction:.0%} live", shape, fmt, n_live * group_bytes, us, "h2d")
                if fmt in ("nvfp4", "fp8"):  # as one-token steps run it (f16x2): on the pairs the up projection wrote
                    hp = h_pairs(hz, fmt == "fp8")
                    us = time_calls([lambda b=b: down_relaid(b, offs, hz, L["down"], skip=True, f16x2=True, pairs=hp) for b in hbanks])
                    add(f"zero-copy down (f16x2), {live_fraction:.0%} live", shape, fmt, n_live * group_bytes, us, "h2d")
                del hbanks
    return ceil, rows


def bench_mixed(shapes=("super", "nano"), fmt="nvfp4", from_ram=(0, 1, 2, 4), device="cuda") -> tuple[dict, list[str]]:
    """A direct decode step's expert kernels (ReLU^2 up, re-laid down) over A experts of which R are read from pinned
    host memory (zero-copy) and the rest from VRAM, through one bank base as the direct schedule has it, with and
    without the down kernel's alignment hint for host rows; against all-VRAM and against the PCIe floor (the R
    blocks' bytes over the pinned host-to-device rate). Lines of a table."""
    from sluice.kernels.decode import matvec
    from sluice.kernels.down import down_relaid

    device = torch.device(device)
    ceil = ceilings(device)
    lines = [f"{'shape':6} {'R':>2} {'variant':14} {'us':>8} {'PCIe floor us':>13} {'x floor':>8}"]
    for shape in shapes:
        kind, Dx, I, A = SHAPES[shape]
        assert kind == "relu2", "the mixed bench times ReLU^2 experts"
        vbanks, L, block_bytes = make_banks(kind, fmt, Dx, I, A, device)
        hbanks, _, _ = make_banks(kind, fmt, Dx, I, A, device, pin=True)
        x = torch.randn(Dx, device=device, dtype=torch.bfloat16)
        h = torch.empty(A, I, device=device, dtype=torch.bfloat16)
        nbytes = L["up"].nbytes + L["down"].nbytes
        for R in from_ram:
            floor = R * nbytes / (ceil["h2d"] * 1e3)  # us
            ram = torch.zeros(A, dtype=torch.bool)
            ram[torch.randperm(A, generator=torch.Generator().manual_seed(R))[:R]] = True  # R of the K positions
            variants = {}
            for vb, hb in zip(vbanks, hbanks):
                offs = torch.arange(A, dtype=torch.int64) * block_bytes
                offs = torch.where(ram, hb.data_ptr() - vb.data_ptr() + offs, offs).to(device)

                def step(vb=vb, offs=offs, host=None):
                    matvec(vb, offs, x, L["up"], "relu2", torch.bfloat16, h)
                    return down_relaid(vb, offs, h, L["down"], skip=False, host=host)

                variants.setdefault("as in VRAM", []).append(step)
                if R:
                    variants.setdefault("host hint", []).append(lambda step=step: step(host=True))
            for name, fns in variants.items():
                us = time_calls(fns)
                ratio = f"{us / floor:8.2f}" if floor else "       -"
                lines.append(f"{shape:6} {R:2d} {name:14} {us:8.1f} {floor:13.1f} {ratio}")
        del vbanks, hbanks
    return ceil, lines


MATVEC_CONFIGS = [(16, 256, 4), (8, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8), (4, 1024, 4), (32, 128, 4),
                  (4, 512, 2), (2, 1024, 2), (16, 1024, 8), (32, 256, 4), (16, 1024, 4), (32, 1024, 4), (64, 256, 8),
                  (64, 128, 4), (32, 512, 8), (64, 512, 8), (32, 512, 4)]  # (bn, bk, warps)
DOWN_CONFIGS = [(512, 16, 4), (1024, 8, 4), (1024, 16, 8), (256, 16, 4), (512, 32, 4), (1024, 32, 8), (2048, 32, 8),
                (512, 64, 4), (1024, 64, 4), (256, 64, 2)]  # (bd, splits, warps)
PREFILL_CONFIGS = [(16, 64, 64, 4), (32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8), (32, 128, 128, 8), (16, 128, 128, 8),
                   (64, 128, 128, 8), (32, 256, 128, 8), (32, 128, 256, 8), (64, 256, 64, 8)]  # (bm, bn, bk, warps)


def sweep(shapes=tuple(SHAPES), formats=FORMATS, device="cuda", prefill_rows=32, prefill_experts=64,
          only: tuple[str, ...] = ()) -> list[str]:
    """Time each kernel over tile configurations; lines 'kernel shape fmt config us GB/s'. only: just these kernels
    (matvec-up, matvec-up-words-gather, matvec-up-words, matvec-up-f16x2, down-relaid, down-relaid-f16x2, prefill-up)."""
    want = lambda name: not only or name in only  # noqa: E731
    from sluice.kernels.decode import matvec
    from sluice.kernels.down import down_relaid
    from sluice.kernels.prefill import grouped_gemm, tile_items

    device = torch.device(device)
    lines = []
    for shape in shapes:
        kind, Dx, I, A = SHAPES[shape]
        for fmt in formats:
            su = _decode_setup(kind, fmt, Dx, I, A, device)
            banks, L, offs, x, h, up_bytes, epi, gate, act = su.banks, su.L, su.offs, su.x, su.h, su.up_bytes, su.epi, su.gate, su.act
            fp4 = fmt in ("nvfp4", "mxfp4")
            variants = [("matvec-up", 0)] + ([("matvec-up-words-gather", 1), ("matvec-up-words", 2)] if fp4 else []) \
                + ([("matvec-up-f16x2", 3)] if fmt in ("nvfp4", "fp8") else [])  # f16x2: NVFP4 and FP8 (F16X2_DOWN)
            for (bn, bk, nw), (name, words) in [(c, v) for c in MATVEC_CONFIGS for v in variants if want(v[0])]:
                try:
                    us = time_calls([lambda b=b: matvec(b, offs, x, L["up"], epi, torch.bfloat16, h, gate=gate, act=act, bn=bn, bk=bk,
                                                   num_warps=nw, fp4_words=words) for b in banks])
                    lines.append(f"{name} {shape} {fmt} bn={bn} bk={bk} w={nw} {us:.1f}us {up_bytes / us / 1e3:.0f}GB/s")
                except Exception as e:  # a config the compiler rejects (registers, shared memory) is skipped
                    lines.append(f"{name} {shape} {fmt} bn={bn} bk={bk} w={nw} failed: {type(e).__name__}")
            if kind == "relu2":
                hl = torch.relu(torch.randn(A, I, device=device)).to(torch.bfloat16)
                for (bd, sp, nw), (name, f16x2) in [(c, v) for c in DOWN_CONFIGS for v in [("down-relaid", False)]
                                                    + ([("down-relaid-f16x2", True)] if fmt in ("nvfp4", "fp8") else []) if want(v[0])]:
                    us = time_calls([lambda b=b: down_relaid(b, offs, hl, L["down"], skip=False, splits=sp, bd=bd, num_warps=nw, f16x2=f16x2)
                                for b in banks])
                    lines.append(f"{name} {shape} {fmt} bd={bd} splits={sp} w={nw} {us:.1f}us {A * L['down'].nbytes / us / 1e3:.0f}GB/s")
            del banks
            if not want("prefill-up"):
                continue
            E = prefill_experts
            banks, L, block_bytes = make_banks(kind, fmt, Dx, I, E, device)
            offs = torch.arange(E, dtype=torch.int64, device=device) * block_bytes
            T = E * prefill_rows
            xs = torch.randn(T, Dx, device=device, dtype=torch.bfloat16)
            hs = torch.empty(T, I, device=device, dtype=torch.bfloat16)
            rows = torch.arange(T, device=device)
            for bm, bn, bk, nw in PREFILL_CONFIGS:
                items = torch.tensor(tile_items([prefill_rows] * E, bm), dtype=torch.int32, device=device)
                try:
                    us = time_calls([lambda b=b: grouped_gemm(b, offs, xs, rows, items, L["up"], epi, torch.bfloat16, hs, gate=gate, act=act, bm=bm, bn=bn, bk=bk, num_warps=nw) for b in banks])
                    flops = 2 * T * Dx * I * (2 if gate is not None else 1)
                    wb = E * (L["up"].nbytes + (L["gate"].nbytes if gate is not None else 0))
                    lines.append(f"prefill-up {shape} {fmt} rows/expert={prefill_rows} bm={bm} bn={bn} bk={bk} w={nw} {us:.1f}us {wb / us / 1e3:.0f}GB/s {flops / us / 1e6:.1f}TFLOP/s")
                except Exception as e:
                    lines.append(f"prefill-up {shape} {fmt} bm={bm} bn={bn} bk={bk} w={nw} failed: {type(e).__name__}")
            del banks
    return lines


def format_table(ceil: dict, rows: list[Row]) -> str:
    head = (f"ceilings: HBM {ceil['hbm']:.0f} GB/s (device copy, read+write), pinned H2D {ceil['h2d']:.1f} GB/s" if "hbm" in ceil
            else "ceilings: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in ceil.items()))
    out = [head, f"{'kernel':34} {'shape':10} {'fmt':6} {'MB':>8} {'us':>8} {'GB/s':>8} {'% of':>10}"]
    for r in rows:
        out.append(f"{r.kernel:34} {r.shape:10} {r.fmt:6} {r.mbytes:8.2f} {r.us:8.1f} {r.gbps:8.1f} {r.pct:6.0f}% {r.ceiling}")
    return "\n".join(out)
