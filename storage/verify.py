"""`sluice verify STORE`: every block against its checksum and, byte for byte, against the source.

The re-layout is undone before comparing, so this checks the repack itself, not just the disk.
Resident tensors are compared with the source too. Returns a list of problems (empty: all good).
"""

from __future__ import annotations

import os
from pathlib import Path

from tqdm import tqdm

from sluice.errors import StoreError
from sluice.models import get_architecture
from sluice.storage.checkpoint import Checkpoint
from sluice.storage.repack import classify
from sluice.storage.safetensors_io import read_bytes, read_header
from sluice.storage.store import ExpertStore, unrelay


def verify(store_path: str | Path, source: str | Path | None = None, progress: bool = True) -> list[str]:
    store = ExpertStore.open(store_path)
    m = store.manifest
    recorded = m.source.get("path") if isinstance(m.source, dict) else None
    if source is None and not isinstance(recorded, str):
        raise StoreError(f"{store.path / 'manifest.json'}: records no source checkpoint path; pass --source PATH")
    src_path = Path(source) if source is not None else Path(recorded)
    if not src_path.is_dir():
        raise StoreError(f"source checkpoint {src_path} is not available; pass --source PATH")
    ckpt = Checkpoint.open(src_path)
    arch, hf = get_architecture(m.architecture), ckpt.hf_config()
    ex = classify(ckpt, arch.expert_spec(hf), arch.ignored(hf))
    problems: list[str] = []
    for name in m.files:
        try:
            store.check_file(name)
        except StoreError as e:
            problems.append(str(e))
    if ex.slots != m.slots or ex.block_bytes != m.block_bytes:
        problems.append("block layout differs from what the source checkpoint gives")
        return problems

    fds: dict[Path, int] = {}
    bar = tqdm(total=store.total_blocks, unit="block", desc="verify", disable=not progress)
    try:
        for layer in store.moe_layers:
            with open(store.file(layer), "rb") as f:
                for expert in range(store.num_experts):
                    block = f.read(store.block_bytes)
                    where = f"layer {layer}, expert {expert}"
                    if store.digest(block) != store.checksum(layer, expert):
                        problems.append(f"{where}: checksum mismatch")
                    end = 0
                    for slot in m.slots:
                        stored = block[slot.offset : slot.offset + slot.nbytes]
                        if unrelay(stored, slot) != read_bytes(ex.blocks[(layer, expert)][slot.name], fds):
                            problems.append(f"{where}: {slot.name} differs from the source")
                        end = max(end, slot.offset + slot.nbytes)
                    if any(block[end:]):
                        problems.append(f"{where}: padding is not zero")
                    bar.update(1)
        resident, _ = read_header(store.path / m.resident)
        if set(resident) != set(ex.resident):
            problems.append(f"resident.safetensors holds {len(resident)} tensors, the source {len(ex.resident)}")
        for name, info in resident.items():
            if name in ex.resident and read_bytes(info, fds) != read_bytes(ex.resident[name], fds):
                problems.append(f"resident tensor {name} differs from the source")
    finally:
        bar.close()
        for fd in fds.values():
            os.close(fd)
    return problems
