"""Safetensors at the byte level: headers without loading weights, raw byte ranges, raw writes.

Sluice never decodes a checkpoint tensor to move it: the expert store and resident.safetensors
hold the checkpoint's own bytes. This module reads a file's JSON header (8-byte little-endian
length, then JSON), validates it against the file size, and returns byte ranges; the writer
emits a safetensors file from (name, dtype, shape, bytes) records, streaming.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from sluice.errors import CheckpointError

# safetensors dtype names <-> torch dtypes and element sizes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
TORCH_TO_ST = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def dtype_size(st_dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[st_dtype]).element_size()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor inside a safetensors file: where its bytes are, not the bytes."""

    name: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: Path, headers_only: bool = False) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors header. Returns (tensors by name, __metadata__).

    headers_only: the file may hold just its header (planning without the weights); byte ranges
    are then not checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes); truncated?")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry: {spec!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * dtype_size(dtype) or begin < 0:
            raise CheckpointError(f"{path}: tensor {name!r} byte range {begin}..{end} does not match {dtype}{list(shape)}")
        if base + end > size and not headers_only:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {base + end}, past the end of the file ({size}); truncated?")
        tensors[name] = TensorInfo(name, path, dtype, shape, base + begin, end - begin)
    return tensors, meta


@dataclass(frozen=True)
class TensorPart:
    """Expert `index` of a fused [E, ...] checkpoint tensor, seen as a tensor of its own.

    Trailing dims are flattened to 2-D [rows, cols] (a 1-D [rows] stays 1-D). `transpose` turns a
    checkpoint's [in, out] into [out, in]; then rows start:stop:step are kept (gpt-oss interleaves
    gate and up rows, step 2; Qwen3.5 stacks gate over up, a half each). Its bytes are a permutation
    of a byte range of the whole tensor: no value is changed."""

    whole: TensorInfo
    index: int
    transpose: bool = False
    start: int = 0
    step: int = 1
    stop: int | None = None

    @property
    def name(self) -> str:
        sliced = self.step > 1 or self.start or self.stop is not None
        rows = f"[{self.start}:{'' if self.stop is None else self.stop}:{self.step}]" if sliced else ""
        return f"{self.whole.name}[{self.index}]{'.T' if self.transpose else ''}{rows}"

    @property
    def file(self) -> Path:
        return self.whole.file

    @property
    def dtype(self) -> str:
        return self.whole.dtype

    def _matrix(self) -> tuple[int, int]:
        sub = self.whole.shape[1:]
        cols = 1
        for d in sub[1:]:
            cols *= d
        return sub[0], cols

    @property
    def shape(self) -> tuple[int, ...]:
        rows, cols = self._matrix()
        if self.transpose:
            rows, cols = cols, rows
        rows = len(range(*slice(self.start, self.stop, self.step).indices(rows)))
        return (rows,) if len(self.whole.shape) == 2 else (rows, cols)

    @property
    def nbytes(self) -> int:
        n = dtype_size(self.dtype)
        for d in self.shape:
            n *= d
        return n

    def read(self, fd_cache: dict[Path, int] | None = None) -> bytes:
        rows, cols = self._matrix()
        per = self.whole.nbytes // self.whole.shape[0]
        part = TensorInfo(self.name, self.whole.file, self.dtype, self.whole.shape[1:], self.whole.offset + self.index * per, per)
        t = torch.frombuffer(bytearray(read_bytes(part, fd_cache)), dtype=torch.uint8).view(rows, cols, -1)
        if self.transpose:
            t = t.permute(1, 0, 2)
        return t[self.start : self.stop : self.step].contiguous().numpy().tobytes()


def read_bytes(info: TensorInfo | TensorPart, fd_cache: dict[Path, int] | None = None) -> bytes:
    """The tensor's raw bytes, exactly as stored (a TensorPart's: its slice, permuted as it says)."""
    if isinstance(info, TensorPart):
        return info.read(fd_cache)
    if fd_cache is not None:
        fd = fd_cache.get(info.file)
        if fd is None:
            fd = fd_cache[info.file] = os.open(info.file, os.O_RDONLY)
        data = os.pread(fd, info.nbytes, info.offset)
    else:
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise CheckpointError(f"{info.file}: short read of {info.name!r} ({len(data)} of {info.nbytes} bytes)")
    return data


def to_tensor(info: TensorInfo, data: bytes) -> torch.Tensor:
    """A CPU tensor over a copy of `data` with the tensor's dtype and shape."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return t.view(info.torch_dtype).reshape(info.shape)


@dataclass(frozen=True)
class RawTensor:
    """A tensor to write: its name, safetensors dtype, shape and bytes (or a source to copy from)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: TensorInfo | None = None
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return self.source.nbytes if self.source is not None else len(self.data or b"")


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    n = dtype_size(dtype)
    for d in shape:
        n *= d
    return n


def encode_header(tensors: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None) -> bytes:
    """The file's first bytes for (name, dtype, shape, nbytes) tensors stored back to back in this order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, n in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def write_header_only(path: Path, tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> None:
    """A safetensors file holding only the header of (name, dtype, shape) tensors: what `plan` needs."""
    with open(path, "wb") as f:
        f.write(encode_header((name, dtype, shape, nbytes_of(dtype, shape)) for name, dtype, shape in sorted(tensors)))


def write_file(path: Path, tensors: Iterable[RawTensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file, copying each tensor's bytes from its source without decoding."""
    tensors = sorted(tensors, key=lambda t: t.name)
    fds: dict[Path, int] = {}
    try:
        with open(path, "wb") as f:
            f.write(encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata))
            for t in tensors:
                f.write(read_bytes(t.source, fds) if t.source is not None else (t.data or b""))
            _fsync(f)
    finally:
        for fd in fds.values():
            os.close(fd)


def _fsync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
