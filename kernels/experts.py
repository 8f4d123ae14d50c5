"""A batch of routed experts through the Triton kernels, as the compute stage calls it.

Shape legend: T tokens, K top-k, A experts in the batch, R rows (token, k) they serve, Dx expert
input size, I intermediate size. One-token steps use the matvec kernels (kernels/decode.py),
longer ones the grouped GEMM (kernels/prefill.py); either way each projection is one launch for
the whole batch. Outputs go to each row's own slot of y [T*K, Dx]: nothing is accumulated here.

With `graphs` (CUDA), a one-token batch of A experts replays a CUDA graph of its kernels, captured
on first use per A (and per banks, dtypes, zero-skip): the block offsets, input and weights are
copied into the graph's static inputs, so the host pays one replay instead of each kernel launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.kernels.decode import ACTS, F16X2_DOWN, FP4_WORDS, matvec
from sluice.kernels.down import down_relaid, ordered_sum, weigh_parts
from sluice.kernels.dequant import FORMAT_CODES, SCALE_GROUPS
from sluice.kernels.layout import proj_layouts
from sluice.kernels.prefill import grouped_gemm, tile_items
from sluice.kernels.graphs import GraphPools

BM = 64  # prefill row tile: the H200 sweep's best for FP8 / BF16 at ~32 rows per expert (BENCHMARKS.md)


@dataclass(frozen=True)
class PlannedGroups:
    """A prompt layer's rows sorted by expert (flat_rows [R]: token * K + k), planned once for its groups of experts
    (`TritonExperts.plan_groups`): a group's tiles index the layer's offsets and rows, so groups share these tensors."""
    items: torch.Tensor  # int32 [n, 3] on the device: (expert index into the layer's offsets, first row, rows) per tile
    spans: tuple[tuple[int, int, int], ...]  # per group: (its first tile in items, its tiles, its row tile BM)
    flat_rows: torch.Tensor  # [R] the rows' flat positions, where the down projection's weighted rows go in y
    xrows: torch.Tensor  # [R] each row's token: its row of the expert input
    hrows: torch.Tensor  # [R] arange: each row's row of h
    wts: torch.Tensor  # [R] each row's routing weight
    h: torch.Tensor  # [R, I] the up projection's activated output, every group's rows


class TritonExperts:
    def __init__(self, manifest, kind: str, act: str, device: torch.device, act_args: tuple[float, float] = (0.0, 0.0),
                 graphs: bool = False, fp4_words: int = FP4_WORDS, pools: GraphPools | None = None):
        if act not in ACTS:
            raise NotImplementedError(f"Triton expert kernels support activations {sorted(ACTS)}, not {act!r}")
        self.layouts = proj_layouts(manifest.formats, manifest.slots)
        self.kind = kind
        self.act = ACTS[act]
        self.act_args = act_args  # (alpha, limit) of gpt-oss's GLU
        self.device = device
        self.live_groups = torch.zeros((), dtype=torch.int64, device=device)  # ReLU^2 groups read by the down kernel
        self.total_groups = 0
        self.graphs = graphs and device.type == "cuda"
        self.pools = pools or GraphPools()  # the memory of the graphs it captures (the engine's, shared)
        self.fp4_words = fp4_words  # the one-token matvecs' FP4 formulation (kernels/decode.py matvec)
        self._rows: dict[int, torch.Tensor] = {}  # A -> arange(A) on the device: the weighted epilogue's rows
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def run(self, bank, offs, down_bank, down_offs, counts: list[int], flat_rows: torch.Tensor, K: int,
            xe: torch.Tensor, w_flat: torch.Tensor, y: torch.Tensor, zero_skip: bool) -> None:
        """Experts a = 0..A-1 (blocks at bank + offs[a], their down at down_bank + down_offs[a]) on their rows.

        counts [A] rows per expert; flat_rows [R] their flat (token * K + k) positions, grouped by expert;
        xe [T, Dx] expert input; w_flat [T*K] routing weights; y [T*K, Dx] output rows."""
        A, R = len(counts), flat_rows.numel()
        if R == A and xe.shape[0] == 1:  # one token: one row per expert
            wts = w_flat[flat_rows]
            self.count_groups(A)
            if self.graphs:
                y[flat_rows] = self._decode_graphed(bank, offs, down_bank, down_offs, xe[0], wts, y.dtype, zero_skip)
            else:
                y[flat_rows] = self._decode(bank, offs, down_bank, down_offs, xe[0], wts, y.dtype, zero_skip)
            return
        self.run_group(self.plan_groups([counts], flat_rows, K, xe, w_flat), 0, bank, offs, down_bank, down_offs, xe, y)

    def tile_rows(self, most: int) -> int:
        """The grouped GEMMs' row tile for experts of at most `most` rows."""
        if self.layouts["up"].fmt in SCALE_GROUPS:  # FP4: 16-row tiles up to 32 rows an expert, 32 up to 48, then 64 (the H200 sweep)
            return 16 if most <= 32 else 32 if most <= 48 else 64
        return BM if most > 16 else 16  # short prompts: do not pad every expert to 64 rows

    def plan_groups(self, groups: list[list[int]], flat_rows: torch.Tensor, K: int, xe: torch.Tensor,
                    w_flat: torch.Tensor) -> "PlannedGroups":
        """A prompt layer's groups of experts (rows per expert, in the order of the layer's offsets and of flat_rows
        [R]), planned once: every group's tiles in one copy to the device, the rows' inputs, weights and the up
        projection's output for them all, so that each group costs two launches (`run_group`)."""
        items, spans, a0, j0 = [], [], 0, 0
        for counts in groups:
            bm = self.tile_rows(max(counts))
            first = len(items)
            items += [(a0 + a, j0 + j, n) for a, j, n in tile_items(counts, bm)]
            spans.append((first, len(items) - first, bm))
            a0, j0 = a0 + len(counts), j0 + sum(counts)
        host = torch.tensor(items, dtype=torch.int32)
        dev = xe.device
        return self._planned((host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True), tuple(spans),
                             flat_rows, K, xe, w_flat[flat_rows])

    def _planned(self, items: torch.Tensor, spans: tuple, flat_rows: torch.Tensor, K: int, xe: torch.Tensor,
                 wts: torch.Tensor) -> "PlannedGroups":
        R = flat_rows.numel()
        return PlannedGroups(items=items, spans=spans, flat_rows=flat_rows, xrows=flat_rows // K,
                             hrows=torch.arange(R, device=xe.device), wts=wts,
                             h=torch.empty(R, self.layouts["up"].n, dtype=xe.dtype, device=xe.device))

    def run_group(self, p: "PlannedGroups", g: int, bank, offs, down_bank, down_offs, xe: torch.Tensor,
                  y: torch.Tensor, tile: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Group g of `p` (blocks at bank + offs[a] for the layer's expert indices a): its up and down grouped GEMMs,
        the same tiles and sums as `run` on the group alone. tile: (BN, BK, warps), 0 for the format's."""
        first, n, bm = p.spans[g]
        if not n:
            return
        L, x_dtype, items = self.layouts, xe.dtype, p.items[first : first + n]
        bn, bk, nw = tile
        if self.kind == "relu2":
            grouped_gemm(bank, offs, xe, p.xrows, items, L["up"], "relu2", x_dtype, p.h, act=self.act, bm=bm, bn=bn, bk=bk,
                         num_warps=nw)
        else:
            grouped_gemm(bank, offs, xe, p.xrows, items, L["up"], "swiglu", x_dtype, p.h, gate=L["gate"], act=self.act,
                         act_args=self.act_args, bm=bm, bn=bn, bk=bk, num_warps=nw)
        grouped_gemm(down_bank, down_offs, p.h, p.hrows, items, L["down"], "weighted", x_dtype, y, orows=p.flat_rows,
                     wts=p.wts, bm=bm, bn=bn, bk=bk, num_warps=nw)

    def run_rows(self, bank, offs: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, xe: torch.Tensor, w: torch.Tensor,
                 y: torch.Tensor, tile: tuple[int, int, int] = (0, 0, 0)) -> None:
        """T rows' experts in one pass with no host wait: ids [T, K] and w [T, K] on the device, counts [E] the rows
        of each expert, offs [E] every expert's block offset from bank (a layer's device table row), so each block is
        read once, where it lies, for all the rows that chose it. The (row, k) pairs are grouped by expert on the
        device (a stable sort: an expert's rows in row order, as the host groups them) into 16-row tiles for every
        expert, a tile of no rows reading nothing. y [T*K, Dx]: each pair's weighted output in its own row."""
        T, K = ids.shape
        E, dev = offs.numel(), ids.device
        rows = torch.argsort(ids.reshape(-1), stable=True)
        # each expert's tiles: a row's top-k are distinct experts, so an expert has at most T rows
        first = (counts.cumsum(0) - counts)[:, None] + torch.arange(0, T, 16, device=dev)
        size = (counts[:, None] + first[:, :1] - first).clamp(0, 16)
        expert = torch.arange(E, device=dev)[:, None].expand_as(first)
        items = torch.stack((expert, first, size), dim=-1).reshape(-1, 3).to(torch.int32)
        p = self._planned(items, ((0, items.shape[0], 16),), rows, K, xe, w.reshape(-1)[rows])
        self.run_group(p, 0, bank, offs, bank, offs, xe, y, tile)

    def run_token(self, bank, offs: list[int], down_bank, down_offs: list[int], positions: list[int], x: torch.Tensor,
                  w: torch.Tensor, y: torch.Tensor, zero_skip: bool) -> None:
        """A one-token step's batch of A experts, their block offsets and output positions given as host ints:
        expert a's weighted output goes to y[positions[a]]. x [Dx]; w [K] the token's routing weights.

        With graphs the three lists reach the GPU in one small copy into the graph's static input, and the
        weights are gathered inside the graph: a replay costs the host four calls."""
        A = len(offs)
        self.count_groups(A)
        meta = torch.tensor(offs + down_offs + positions, dtype=torch.int64).view(3, A)
        if not self.graphs:
            meta = meta.to(x.device, non_blocking=True)
            y[meta[2]] = self._decode(bank, meta[0], down_bank, meta[1], x, w[meta[2]], y.dtype, zero_skip)
            return
        key = ("token", A, bank.data_ptr(), down_bank.data_ptr(), x.dtype, w.dtype, w.numel(), y.dtype, zero_skip)
        found = self._graphs.get(key)
        if found is None:
            static = {"meta": meta.to(x.device), "x": x.clone(), "w": w.clone()}
            out = self._capture(key, static, lambda s: self._decode(bank, s["meta"][0], down_bank, s["meta"][1], s["x"],
                                                                     s["w"][s["meta"][2]], y.dtype, zero_skip))
            y.index_copy_(0, static["meta"][2], out)
            return
        graph, static = found
        static["meta"].copy_(meta, non_blocking=True)  # 3A ints from pageable memory: staged by the driver, async
        static["x"].copy_(x)
        static["w"].copy_(w)
        graph.replay()
        y.index_copy_(0, static["meta"][2], static["out"])

    def count_groups(self, A: int) -> None:
        """Count a one-token batch of A experts' ReLU^2 down groups (the live ones are counted on the device, at
        replays too; this host count is kept outside any graph)."""
        if self.kind == "relu2":
            self.total_groups += A * (self.layouts["down"].k // 16)

    def _decode(self, bank, offs, down_bank, down_offs, x: torch.Tensor, wts: torch.Tensor, y_dtype: torch.dtype,
                zero_skip: bool, host: bool | None = None, summed: bool = False) -> torch.Tensor:
        """One token x [Dx] through A experts: weighted outputs [A, Dx] in y_dtype (expert a's in row a), or (summed)
        their sum over a in order (kernels/down.py `ordered_sum`), [1, Dx] in x's dtype. host: some blocks may be in
        host memory (kernels/down.py down_relaid)."""
        L, A, x_dtype = self.layouts, offs.numel(), x.dtype
        h = torch.empty(A, L["up"].n, dtype=x_dtype, device=x.device)
        if self.kind == "relu2":
            pairs = None  # the f16x2 down's packed h, written by the up projection's epilogue
            if self.fp4_words == 3 and L["down"].fmt in F16X2_DOWN and L["down"].n % 4 == 0:
                pairs = (torch.empty(A, L["up"].n // 2, dtype=torch.int32, device=x.device),
                         torch.empty(A, L["up"].n // 16, dtype=torch.float32, device=x.device))
            matvec(bank, offs, x, L["up"], "relu2", x_dtype, h, act=self.act, fp4_words=self.fp4_words, pairs=pairs,
                   pairs_fp8=L["down"].fmt != FORMAT_CODES["nvfp4"])
            part, live = down_relaid(down_bank, down_offs, h, L["down"], skip=zero_skip, host=host, f16x2=pairs is not None,
                                     pairs=pairs)
            return weigh_parts(part, wts, live, self.live_groups, x_dtype, y_dtype, summed)
        matvec(bank, offs, x, L["up"], "swiglu", x_dtype, h, gate=L["gate"], act=self.act, act_args=self.act_args,
               fp4_words=self.fp4_words)
        out = torch.empty(A, L["down"].n, dtype=y_dtype, device=x.device)
        rows = self._rows.get(A)
        if rows is None:
            rows = torch.arange(A, device=x.device)
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):  # kept only where made outside a graph's pool
                self._rows[A] = rows
        out = matvec(down_bank, down_offs, h, L["down"], "weighted", x_dtype, out, rows=rows, wts=wts, fp4_words=self.fp4_words)
        return ordered_sum(out[None], x_dtype) if summed else out

    def _capture(self, key: tuple, static: dict, run) -> torch.Tensor:
        """The first call for `key`: run(static) eagerly (compiling any kernel; its result is returned), then
        captured as a graph whose output is static["out"]. The capture records and runs nothing (live_groups
        counts at replays only); thread-local: the hybrid path's worker thread may allocate pinned memory
        meanwhile, which a global-mode capture would turn into an error."""
        out = run(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pools.current(), capture_error_mode="thread_local"):
            static["out"] = run(static)
        self._graphs[key] = (graph, static)
        return out

    def _decode_graphed(self, bank, offs, down_bank, down_offs, x, wts, y_dtype, zero_skip) -> torch.Tensor:
        """`_decode` through a CUDA graph. The first call per key runs eagerly (compiling any kernel), then
        captures; the graph's output buffer is overwritten by the next replay, so callers copy it out (before any
        other graph on the stream replays: its memory is in the stream's shared pool, kernels/graphs.py)."""
        key = (offs.numel(), bank.data_ptr(), down_bank.data_ptr(), x.dtype, wts.dtype, y_dtype, zero_skip)
        found = self._graphs.get(key)
        if found is None:
            static = {"offs": offs.clone(), "down_offs": down_offs.clone(), "x": x.clone(), "wts": wts.clone()}
            return self._capture(key, static, lambda s: self._decode(bank, s["offs"], down_bank, s["down_offs"], s["x"], s["wts"],
                                                                      y_dtype, zero_skip))
        graph, static = found
        static["offs"].copy_(offs)
        static["down_offs"].copy_(down_offs)
        static["x"].copy_(x)
        static["wts"].copy_(wts)
        graph.replay()
        return static["out"]
