"""The expert store on disk: one 4 KiB-aligned block per (MoE layer, expert), and its manifest.

    STORE/
      manifest.json              format version, source identity, block layout, a checksum per block
      experts/layer_LLL.bin      E blocks of `block_bytes` each, expert e at offset e * block_bytes
      resident.safetensors       every tensor that is not a routed expert, in the checkpoint's bytes
      config.json, tokenizer*    copied from the checkpoint

A block holds the expert's tensors back to back (each at a 256-byte aligned offset), in the
checkpoint's own dtype and bytes. ReLU^2 experts' `down` [Dx, I] is stored transposed, [I, Dx]:
a pure byte permutation that makes each neuron's weights contiguous, so a kernel can read only
the 16-neuron groups that are live after ReLU^2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from sluice.errors import StoreError
from sluice.kernels.formats import WeightFormat
from sluice.storage.safetensors_io import DTYPES

FORMAT = "sluice-expert-store"
VERSION = 3  # 2: per-projection weight formats in the manifest; 3: the checksum named (xxh3_64 by default)
READS = (2, 3)  # versions this code opens (a version 2 store's checksums are xxh64)
# a block's checksum, by the manifest's name for it: new stores take the faster xxh3_64, as a checksum is part of each
# disk read's latency (docs/benchmarks/2026-12-02.md)
CHECKSUMS = {"xxh64": xxhash.xxh64_intdigest, "xxh3_64": xxhash.xxh3_64_intdigest}
CHECKSUM = "xxh3_64"  # what new stores use
PAGE = 4096
TENSOR_ALIGN = 256


def round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass(frozen=True)
class TensorSlot:
    """Where one expert tensor sits inside every block of the store."""

    name: str  # "<proj>.<suffix>", e.g. "down.weight"
    proj: str  # up | gate | down
    suffix: str  # weight | weight_scale | weight_scale_2 | input_scale
    offset: int  # bytes from the block start
    nbytes: int
    shape: tuple[int, ...]  # the checkpoint's shape
    dtype: str  # safetensors dtype name
    relaid: bool  # stored transposed (2-D only)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.relaid else self.shape

    def view(self, block: torch.Tensor) -> torch.Tensor:
        """This tensor inside a block buffer (uint8 [block_bytes]), as stored (relaid: transposed)."""
        return block[self.offset : self.offset + self.nbytes].view(DTYPES[self.dtype]).view(self.stored_shape)

    def logical(self, block: torch.Tensor) -> torch.Tensor:
        """The same bytes in the checkpoint's orientation (a transposed view when re-laid)."""
        v = self.view(block)
        return v.t() if self.relaid else v

    def to_json(self) -> dict:
        return {**self.__dict__, "shape": list(self.shape)}


def plan_layout(entries: list[tuple[str, str, tuple[int, ...], str, int, bool]]) -> tuple[tuple[TensorSlot, ...], int]:
    """Lay tensors (proj, suffix, shape, dtype, nbytes, relaid) out in order. Returns (slots, block_bytes)."""
    slots, offset = [], 0
    for proj, suffix, shape, dtype, nbytes, relaid in entries:
        offset = round_up(offset, TENSOR_ALIGN)
        if relaid and len(shape) != 2:
            raise StoreError(f"cannot re-lay {proj}.{suffix}: shape {list(shape)} is not 2-D")
        slots.append(TensorSlot(f"{proj}.{suffix}", proj, suffix, offset, nbytes, tuple(shape), dtype, relaid))
        offset += nbytes
    return tuple(slots), round_up(max(offset, 1), PAGE)


def pack_block(slots: tuple[TensorSlot, ...], tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write tensors (slot name -> tensor in checkpoint orientation) into a block buffer (uint8 [block_bytes]).

    The torch twin of `relay`: re-laid slots are written transposed. Works on any device."""
    for slot in slots:
        t = tensors[slot.name]
        if slot.relaid:
            t = t.t()
        out[slot.offset : slot.offset + slot.nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
    return out


def relay(data: bytes, slot: TensorSlot) -> bytes:
    """Checkpoint bytes -> stored bytes (transpose when re-laid). A byte permutation: same size."""
    if not slot.relaid:
        return data
    return _transpose_bytes(data, slot.shape, slot.dtype)


def unrelay(data: bytes, slot: TensorSlot) -> bytes:
    """Stored bytes -> checkpoint bytes; the inverse of `relay`."""
    if not slot.relaid:
        return data
    return _transpose_bytes(data, slot.stored_shape, slot.dtype)


def _transpose_bytes(data: bytes, shape: tuple[int, ...], dtype: str) -> bytes:
    rows, cols = shape
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(rows, cols, -1)
    return t.permute(1, 0, 2).contiguous().numpy().tobytes()


@dataclass(frozen=True)
class StoreLayer:
    layer: int  # model layer index
    file: str  # relative to the store
    checksums: tuple[str, ...]  # hex per expert, of the manifest's `checksum`


@dataclass(frozen=True)
class Manifest:
    architecture: str
    kind: str  # relu2 | swiglu
    num_experts: int
    top_k: int
    block_bytes: int
    slots: tuple[TensorSlot, ...]
    formats: dict[str, WeightFormat]  # projection -> how its weight is stored
    layers: tuple[StoreLayer, ...]
    source: dict
    resident: str = "resident.safetensors"
    encoder: str | None = None  # a vision-language model's image encoder tensors, in the checkpoint's names and bytes
    checksum: str = CHECKSUM  # the blocks' checksum (CHECKSUMS)
    files: dict[str, str] = field(default_factory=dict)  # whole-file checksums ("xxh3_64:<hex>"): resident, encoder

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "architecture": self.architecture,
            "expert_kind": self.kind,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "block_bytes": self.block_bytes,
            "checksum": self.checksum,
            "tensors": [s.to_json() for s in self.slots],
            "formats": {p: f.to_json() for p, f in self.formats.items()},
            "layers": [{"layer": l.layer, "file": l.file, "checksums": list(l.checksums)} for l in self.layers],
            "source": self.source,
            "resident": self.resident,
            **({"encoder": self.encoder} if self.encoder else {}),
            **({"files": self.files} if self.files else {}),
        }

    @classmethod
    def from_json(cls, d: dict, where: Path) -> "Manifest":
        if not isinstance(d, dict):
            raise StoreError(f"{where}: malformed manifest (a JSON {type(d).__name__}, not an object)")
        if d.get("format") != FORMAT:
            raise StoreError(f"{where}: not a Sluice expert store manifest (format={_short(d.get('format'))})")
        if d.get("version") not in READS:
            raise StoreError(f"{where}: store format version {_short(d.get('version'))} is not supported (this Sluice reads "
                             f"versions {', '.join(map(str, READS))}); repack with --force")
        checksum = d.get("checksum", "xxh64" if d["version"] == 2 else None)  # version 2 stores may not name theirs
        if checksum is None:
            raise StoreError(f"{where}: malformed manifest (no block checksum named)")
        if not isinstance(checksum, str) or checksum not in CHECKSUMS:
            raise StoreError(f"{where}: unknown block checksum {_short(checksum)} (known: {', '.join(CHECKSUMS)})")
        try:
            for key in ("num_experts", "top_k", "block_bytes"):
                _check_int(d[key], key, where, 1)
            slots = tuple(TensorSlot(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"])
            for t in slots:
                _check_int(t.offset, f"tensor {t.name!r} offset", where, 0)
                _check_int(t.nbytes, f"tensor {t.name!r} nbytes", where, 1)
                if t.offset + t.nbytes > d["block_bytes"]:
                    raise StoreError(f"{where}: malformed manifest (tensor {t.name!r} ends past the {d['block_bytes']}-byte block)")
            formats = {p: WeightFormat.from_json(f) for p, f in d["formats"].items()}
            layers = tuple(StoreLayer(l["layer"], l["file"], tuple(l["checksums"])) for l in d["layers"])
            for l in layers:
                _check_int(l.layer, "layer", where, 0)
                _check_name(l.file, f"layer {l.layer} file", where)
            files = d.get("files", {})
            if not isinstance(files, dict) or not all(isinstance(v, str) and v.split(":")[0] in CHECKSUMS for v in files.values()):
                raise StoreError(f"{where}: malformed manifest ('files' must map names to checksums)")
            resident = d.get("resident", "resident.safetensors")
            for name in (resident, d.get("encoder"), *files):
                if name is not None:
                    _check_name(name, "file name", where)
            return cls(d["architecture"], d["expert_kind"], d["num_experts"], d["top_k"], d["block_bytes"], slots, formats, layers,
                       d["source"], resident, d.get("encoder"), checksum, files)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise StoreError(f"{where}: malformed manifest ({_short(e)})") from None


def _short(value, n: int = 80) -> str:
    """repr cut to n characters: a message names a bad value, it does not print a megabyte of it."""
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


def _check_int(value, key: str, where: Path, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StoreError(f"{where}: malformed manifest ({key} must be an integer >= {low}, got {_short(value)})")


def _check_name(name, key: str, where: Path) -> None:
    """A path inside the store: relative, no `..` (a manifest never points outside its folder)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise StoreError(f"{where}: malformed manifest ({key} must be a path inside the store, got {_short(name)})")


def file_checksum(path: Path, checksum: str = CHECKSUM, piece: int = 8 << 20) -> str:
    """"<checksum>:<hex>" of a whole file, read in pieces (bounded memory); the name travels with the value."""
    h = {"xxh64": xxhash.xxh64, "xxh3_64": xxhash.xxh3_64}[checksum]()
    with open(path, "rb") as f:
        while data := f.read(piece):
            h.update(data)
    return f"{checksum}:{h.intdigest():016x}"


class ExpertStore:
    """An opened store: where each block lives and how to view its tensors. Immutable; thread-safe."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self.block_bytes = manifest.block_bytes
        self.slots = {s.name: s for s in manifest.slots}
        self._layers = {l.layer: l for l in manifest.layers}
        self.moe_layers = tuple(l.layer for l in manifest.layers)
        self.digest = CHECKSUMS[manifest.checksum]  # bytes-like -> the int a block's `checksum` is compared with

    @classmethod
    def open(cls, path: str | Path) -> "ExpertStore":
        path = Path(path)
        mf = path / "manifest.json"
        if not mf.is_file():
            raise StoreError(f"{path}: no manifest.json (not an expert store, or its repack did not finish)")
        try:
            manifest = Manifest.from_json(json.loads(mf.read_text()), mf)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreError(f"{mf}: not valid JSON ({e})") from None
        store = cls(path, manifest)
        expected = manifest.num_experts * manifest.block_bytes
        for l in manifest.layers:
            f = path / l.file
            if not f.is_file():
                raise StoreError(f"{path}: block file for layer {l.layer} is missing: {l.file}")
            size = f.stat().st_size
            if size != expected:
                raise StoreError(f"{f}: {size} bytes, expected {expected} ({manifest.num_experts} blocks of {manifest.block_bytes}); truncated store?")
            if len(l.checksums) != manifest.num_experts:
                raise StoreError(f"{mf}: layer {l.layer} has {len(l.checksums)} checksums for {manifest.num_experts} experts")
        for part in (manifest.resident, manifest.encoder, "config.json"):
            if part is not None and not (path / part).is_file():
                raise StoreError(f"{path}: {part} is missing")
        return store

    def resident_tensors(self, verify: bool = True) -> dict[str, torch.Tensor]:
        """The resident tensors (CPU). verify: the file's checksum is checked first (one sequential read; stores
        from before the checksum was recorded are not checked). A damaged file raises StoreError naming it."""
        from safetensors.torch import load_file

        f = self.path / self.manifest.resident
        self.check_file(self.manifest.resident, verify)
        try:
            return load_file(f)
        except Exception as e:  # safetensors raises its own errors for a cut or garbled header
            raise StoreError(f"{f}: unreadable ({_short(str(e), 160)}); repack the store (or copy it again)") from None

    def check_file(self, name: str, verify: bool = True) -> None:
        """Raise StoreError if file `name` of the store differs from the checksum the manifest records."""
        want = self.manifest.files.get(name)
        if verify and want is not None and file_checksum(self.path / name, want.split(":")[0]) != want:
            raise StoreError(f"{self.path / name}: checksum mismatch (the file was changed or damaged after repack); "
                             "repack the store (or copy it again)")

    @property
    def num_experts(self) -> int:
        return self.manifest.num_experts

    @property
    def total_blocks(self) -> int:
        return self.num_experts * len(self.moe_layers)

    def file(self, layer: int) -> Path:
        return self.path / self._layer(layer).file

    def offset(self, expert: int) -> int:
        return expert * self.block_bytes

    def checksum(self, layer: int, expert: int) -> int:
        return int(self._layer(layer).checksums[expert], 16)

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slot name -> tensor as stored (relaid tensors transposed)."""
        return {name: slot.view(block) for name, slot in self.slots.items()}

    def logical(self, block: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """proj -> suffix -> tensor in the checkpoint's orientation (what WeightFormat.dequant_ref takes)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for slot in self.slots.values():
            out.setdefault(slot.proj, {})[slot.suffix] = slot.logical(block)
        return out

    def _layer(self, layer: int) -> StoreLayer:
        try:
            return self._layers[layer]
        except KeyError:
            raise StoreError(f"{self.path}: layer {layer} is not a MoE layer of this store") from None
