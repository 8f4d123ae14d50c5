"""Where Sluice keeps what it makes: SLUICE_HOME (default ~/.cache/sluice) holds stores/ (repacked checkpoints,
`resolve_store`), models/ (generated test models) and build/ (the CPU kernel compiled on this machine)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sluice.errors import StoreError
from sluice.log import get_logger


def sluice_home() -> Path:
    return Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice"))


def resolve_store(path: str | Path, progress: bool = True) -> Path:
    """A store path as is; a checkpoint is repacked once into SLUICE_HOME/stores/<name>-<hash>."""
    from sluice.storage.checkpoint import Checkpoint
    from sluice.storage.repack import repack
    from sluice.storage.store import ExpertStore

    log = get_logger()

    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if not (path / "config.json").is_file():
        raise StoreError(f"{path}: neither an expert store (manifest.json) nor a checkpoint (config.json)")
    ckpt = Checkpoint.open(path)
    digest = hashlib.sha256(ckpt.fingerprint()["sha256"].encode() + str(path.resolve()).encode()).hexdigest()[:12]
    target = sluice_home() / "stores" / f"{path.resolve().name}-{digest}"
    stale = False
    if (target / "manifest.json").is_file():
        try:
            ExpertStore.open(target)
        except StoreError as e:  # our own cache, written by an older Sluice: rebuild it
            log.info("the cached expert store cannot be used; repacking", store=str(target), reason=str(e))
            stale = True
    else:
        log.info("repacking checkpoint into an expert store (once)", checkpoint=str(path), store=str(target))
    repack(path, target, force=stale, progress=progress)
    return target
