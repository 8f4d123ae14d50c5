"""`sluice repack CKPT STORE`: checkpoint -> expert store, atomic and resumable.

Work happens in STORE.partial/ (marked by its progress.json). Each MoE layer's block file is
written to a temporary name, fsynced and renamed, then recorded in progress.json, so an
interrupted repack resumes at the first unfinished layer. Only when everything is written is
the folder renamed to STORE; an existing STORE is replaced only with --force, and only after
the new one is complete. Re-running on an up-to-date store only checks it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from sluice.errors import CheckpointError, StoreError
from sluice.kernels.formats import WeightFormat, detect_format
from sluice.models import get_architecture
from sluice.models.base import ExpertSpec
from sluice.storage.checkpoint import Checkpoint
from sluice.storage.safetensors_io import RawTensor, TensorInfo, TensorPart, read_bytes, write_file
from sluice.storage.replace import check_replaceable
from sluice.storage.store import CHECKSUM, CHECKSUMS, ExpertStore, Manifest, StoreLayer, TensorSlot, file_checksum, plan_layout, relay

# inside a block, each projection's tensors in this order (weights first, then scales)
SUFFIX_ORDER = ("weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale",
                "input_scale", "input_global_scale")


@dataclass(frozen=True)
class ExpertTensors:
    """The checkpoint's routed-expert tensors: (layer, expert) -> slot name -> TensorInfo."""

    spec: ExpertSpec
    blocks: dict[tuple[int, int], dict[str, TensorInfo | TensorPart]]
    resident: dict[str, TensorInfo]
    slots: tuple[TensorSlot, ...]
    formats: dict[str, WeightFormat]
    block_bytes: int
    encoder: dict[str, TensorInfo]  # an image encoder's tensors (vision-language checkpoints), kept apart


def classify(ckpt: Checkpoint, spec: ExpertSpec, ignore=lambda name: False, encoder=lambda name: False) -> ExpertTensors:
    """Split tensors into routed experts and resident ones; check every expert is complete and alike.

    Tensors `encoder` names (a vision-language model's image encoder) are kept apart; other tensors
    `ignore` names (not part of the LM) are left out. Fused expert tensors are cut into per-expert
    parts by the spec's `split`."""
    blocks: dict[tuple[int, int], dict[str, TensorInfo | TensorPart]] = {}
    resident, enc = {}, {}
    moe = set(spec.moe_layers)
    for name, info in ckpt.tensors.items():
        if encoder(name):
            enc[name] = info
            continue
        if ignore(name):
            continue
        parts = spec.split(name, info) if spec.split is not None else None
        if parts is not None:
            if info.shape[0] != spec.num_experts:
                raise CheckpointError(f"{info.file.name}: {name!r} holds {info.shape[0]} experts, the config {spec.num_experts}")
            for layer, expert, proj, suffix, part in parts:
                if layer not in moe:
                    raise CheckpointError(f"{info.file.name}: {name!r}: layer {layer} is not a MoE layer of this config")
                blocks.setdefault((layer, expert), {})[f"{proj}.{suffix}"] = part
            continue
        m = spec.pattern.match(name)
        if m is None:
            resident[name] = info
            continue
        layer, expert, raw_proj, suffix = int(m["layer"]), int(m["expert"]), m["proj"], m["suffix"]
        proj = spec.proj_names.get(raw_proj)
        if proj is None:
            raise CheckpointError(f"{info.file.name}: {name!r}: unknown expert projection {raw_proj!r} (expected {', '.join(spec.proj_names)})")
        if layer not in moe or not 0 <= expert < spec.num_experts:
            raise CheckpointError(f"{info.file.name}: {name!r}: layer {layer} expert {expert} is not a routed expert of this config")
        blocks.setdefault((layer, expert), {})[f"{proj}.{suffix}"] = info
    if not spec.moe_layers:
        raise CheckpointError(f"{ckpt.path}: config has no MoE layers")
    first = blocks.get((spec.moe_layers[0], 0))
    if not first:
        raise CheckpointError(f"{ckpt.path}: no routed-expert tensors found for layer {spec.moe_layers[0]} (fused 3-D expert tensors are not supported)")
    entries, formats = [], {}
    for proj in spec.projs:
        found = {k.split(".", 1)[1]: v for k, v in first.items() if k.startswith(proj + ".")}
        where = f"{ckpt.path}: layer {spec.moe_layers[0]} expert 0 {proj}"
        formats[proj] = detect_format({sfx: (i.dtype, i.shape) for sfx, i in found.items()}, where)
        for suffix in sorted(found, key=lambda x: SUFFIX_ORDER.index(x) if x in SUFFIX_ORDER else len(SUFFIX_ORDER)):
            info = found[suffix]
            entries.append((proj, suffix, info.shape, info.dtype, info.nbytes, proj in spec.relaid and len(info.shape) == 2))
    slots, block_bytes = plan_layout(entries)
    names = {s.name: s for s in slots}
    for layer in spec.moe_layers:
        for expert in range(spec.num_experts):
            found = blocks.get((layer, expert), {})
            for slot_name, slot in names.items():
                info = found.get(slot_name)
                if info is None:
                    raise CheckpointError(f"{ckpt.path}: layer {layer} expert {expert}: tensor {slot_name} is missing")
                if info.shape != slot.shape or info.dtype != slot.dtype:
                    raise CheckpointError(f"{info.file.name}: {info.name!r} is {info.dtype}{list(info.shape)}, other experts have {slot.dtype}{list(slot.shape)}")
            extra = set(found) - set(names)
            if extra:
                raise CheckpointError(f"{ckpt.path}: layer {layer} expert {expert}: unexpected tensors {sorted(extra)}")
    return ExpertTensors(spec, blocks, resident, slots, formats, block_bytes, enc)


def build_block(tensors: dict[str, TensorInfo | TensorPart], slots: tuple[TensorSlot, ...], block_bytes: int, fds: dict) -> bytearray:
    block = bytearray(block_bytes)
    for slot in slots:
        data = relay(read_bytes(tensors[slot.name], fds), slot)
        block[slot.offset : slot.offset + slot.nbytes] = data
    return block


def repack(ckpt_path: str | Path, store_path: str | Path, force: bool = False, progress: bool = True) -> ExpertStore:
    ckpt = Checkpoint.open(ckpt_path)
    arch = get_architecture(ckpt.model_type)
    hf = ckpt.hf_config()
    spec = arch.expert_spec(hf)
    ex = classify(ckpt, spec, arch.ignored(hf), arch.encoder(hf))
    source = ckpt.fingerprint()
    store_path = Path(store_path)

    if store_path.exists() or store_path.is_symlink():
        current = _existing_source(store_path)
        if current is not None and current.get("sha256") == source["sha256"] and not force:
            return ExpertStore.open(store_path)  # up to date: opening checks sizes and files
        if not force:
            raise StoreError(f"{store_path} already exists{' and holds another checkpoint' if current else ''}; pass --force to replace it")
        check_replaceable(store_path, ckpt.path, "--force replaces only a Sluice store")

    work = store_path.with_name(store_path.name + ".partial")
    try:
        return _repack(ckpt, arch, spec, ex, source, store_path, work, progress)
    except OSError as e:  # disk full, file size limit, permissions: the work so far stays for a rerun to resume
        raise StoreError(f"{e.filename or work}: cannot write the store: {e.strerror or e}") from None


def _repack(ckpt: Checkpoint, arch, spec: ExpertSpec, ex: ExpertTensors, source: dict, store_path: Path, work: Path,
            progress: bool) -> ExpertStore:
    done = _resume_state(work, source, ckpt.path, spec.num_experts, ex.block_bytes)
    (work / "experts").mkdir(parents=True, exist_ok=True)
    _write_json(work / "progress.json", done)  # marks the folder as this repack's from its first byte

    layers = []
    total = len(spec.moe_layers) * spec.num_experts * ex.block_bytes
    fds: dict[Path, int] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"repack {ckpt.path.name}", disable=not progress)
    try:
        for layer in spec.moe_layers:
            rel = f"experts/layer_{layer:03d}.bin"
            if str(layer) in done["layers"]:
                layers.append(StoreLayer(layer, rel, tuple(done["layers"][str(layer)])))
                bar.update(spec.num_experts * ex.block_bytes)
                continue
            sums = []
            tmp = work / (rel + ".tmp")
            with open(tmp, "wb") as f:
                for expert in range(spec.num_experts):
                    block = build_block(ex.blocks[(layer, expert)], ex.slots, ex.block_bytes, fds)
                    sums.append(f"{CHECKSUMS[CHECKSUM](block):016x}")
                    f.write(block)
                    bar.update(len(block))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, work / rel)
            layers.append(StoreLayer(layer, rel, tuple(sums)))
            done["layers"][str(layer)] = sums
            _write_json(work / "progress.json", done)
    finally:
        bar.close()
        for fd in fds.values():
            os.close(fd)

    files = {}
    for name, part in (("resident.safetensors", ex.resident), ("encoder.safetensors", ex.encoder)):
        if part or name == "resident.safetensors":
            tmp = work / (name + ".tmp")
            write_file(tmp, [RawTensor(i.name, i.dtype, i.shape, source=i) for i in part.values()], {"format": "pt"})
            files[name] = file_checksum(tmp)
            os.replace(tmp, work / name)
    for f in ckpt.side_files():
        shutil.copyfile(f, work / f.name)
    manifest = Manifest(arch.model_type, spec.kind, spec.num_experts, spec.top_k, ex.block_bytes, ex.slots, ex.formats, tuple(layers), source,
                        encoder="encoder.safetensors" if ex.encoder else None, files=files)
    _write_json(work / "manifest.json", manifest.to_json())
    (work / "progress.json").unlink()
    _swap_into_place(work, store_path)
    return ExpertStore.open(store_path)


def _existing_source(store_path: Path) -> dict | None:
    try:
        return json.loads((store_path / "manifest.json").read_text()).get("source")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _resume_state(work: Path, source: dict, ckpt_path: Path, num_experts: int, block_bytes: int) -> dict:
    """progress.json of an interrupted repack of the same source (its layers whose files are whole), or a fresh
    one. Work it cannot resume (another source, no or garbled progress.json) is deleted if it is a store's."""
    fresh = {"source": source, "checksum": CHECKSUM, "layers": {}}
    if not work.exists() and not work.is_symlink():
        return fresh
    try:
        state = json.loads((work / "progress.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        state = None
    ours = isinstance(state, dict) and isinstance(state.get("layers"), dict) and isinstance(state.get("source"), dict)
    if not ours or state["source"].get("sha256") != source["sha256"] or state.get("checksum", "xxh64") != CHECKSUM:
        check_replaceable(work, ckpt_path, "an unfinished repack it cannot resume is cleared")
        shutil.rmtree(work)  # our own unfinished work: for a different checkpoint, other checksums, or killed early
        return fresh
    for layer, sums in list(state["layers"].items()):  # a layer whose file is missing or cut is built again
        f = work / f"experts/layer_{layer:0>3}.bin"
        if not layer.isdigit() or not isinstance(sums, list) or len(sums) != num_experts or not f.is_file() \
                or f.stat().st_size != num_experts * block_bytes:
            del state["layers"][layer]
    return state


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _swap_into_place(work: Path, store_path: Path) -> None:
    if not store_path.exists():
        os.replace(work, store_path)
        return
    old = store_path.with_name(store_path.name + f".old-{os.getpid()}")
    os.replace(store_path, old)
    os.replace(work, store_path)
    shutil.rmtree(old, ignore_errors=True)
