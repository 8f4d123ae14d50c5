"""Where a projection's tensors sit inside a block, in the terms the Triton kernels take.

Built once per store from its manifest (storage/store.py). Offsets are bytes from the block start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.kernels.dequant import FORMAT_CODES, SCALE_GROUPS
from sluice.storage.safetensors_io import DTYPES


@dataclass(frozen=True)
class ProjLayout:
    proj: str
    fmt: int  # kernels.dequant format code
    wdt: torch.dtype  # stored weight dtype (uint8 for FP4, float8 for FP8)
    n: int  # output features (checkpoint orientation [n, k])
    k: int  # input features
    relaid: bool  # stored K-major ([k, n]; ReLU^2 down)
    w_off: int
    s_off: int  # 0 when unused
    s2_off: int
    s_stride: int  # row stride, in elements, of the stored 2-D scale tensor (0 when none)
    s2_inv: bool
    block: int  # FP8 block edge (0 when unused)
    sg: int  # FP4 scale group in elements (16 NVFP4, 32 MXFP4; 16 otherwise, unused)
    b_off: int  # output bias offset, -1 when there is none
    bdt: torch.dtype  # bias dtype (float32 when there is none)
    nbytes: int  # bytes this projection occupies in the block (weights and scales, with padding)
    start: int  # first byte of this projection's tensors in the block


def proj_layouts(formats: dict, slots_all) -> dict[str, ProjLayout]:
    """proj -> layout, from a store manifest's `formats` and `slots` (or any block laid out by plan_layout)."""
    out = {}
    for proj, fmt in formats.items():
        slots = {s.suffix: s for s in slots_all if s.proj == proj}
        w = slots[fmt.weight]
        n, k = w.shape
        if fmt.kind in ("nvfp4", "mxfp4"):
            k *= 2
        s = slots.get(fmt.scale) if fmt.scale else None
        s2 = slots.get(fmt.scale2) if fmt.scale2 else None
        b = slots.get(fmt.bias) if fmt.bias else None
        kind = fmt.kind
        if kind == "fp8" and s is not None and _numel(s.shape) > 1:
            kind = "fp8_row"
        if kind == "fp8_block" and s.dtype == "F8_E8M0":
            kind = "fp8_block_e8m0"
        s_stride = s.stored_shape[1] if s is not None and len(s.shape) == 2 else 0
        first = min(x.offset for x in slots.values())
        last = max(x.offset + x.nbytes for x in slots.values())
        out[proj] = ProjLayout(
            proj, FORMAT_CODES[kind], DTYPES[w.dtype], n, k, w.relaid, w.offset, s.offset if s else 0,
            s2.offset if s2 else 0, s_stride, fmt.scale2_inverted, fmt.block,
            SCALE_GROUPS.get(FORMAT_CODES[kind], 16), b.offset if b else -1, DTYPES[b.dtype] if b else torch.float32,
            last - first, first,
        )
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
