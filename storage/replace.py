"""Which folders a repack may delete: a Sluice store, or an unfinished repack of one; never anything else.

`repack --force` replaces its target, and a rerun clears a STORE.partial it cannot resume. Both remove a
folder, so both first check that every entry in it is a name a store (or its repack's work) holds: a folder of
user files, or the source checkpoint itself, is refused with its name, and nothing is touched.
"""

from __future__ import annotations

import re
from pathlib import Path

from sluice.errors import StoreError
from sluice.storage.checkpoint import SIDE_FILES

# what a store and a repack in progress hold at their top level
STORE_NAMES = frozenset({"manifest.json", "progress.json", "experts", "resident.safetensors", "encoder.safetensors",
                         *SIDE_FILES})
LAYER_FILE = re.compile(r"layer_\d{3,}\.bin(\.tmp)?")


def store_like(path: Path) -> bool:
    """Whether every entry of folder `path` is one a store or its unfinished repack holds (an empty folder is)."""
    for entry in path.iterdir():
        name = entry.name.removesuffix(".tmp")  # a file a repack was writing when it stopped
        if name not in STORE_NAMES:
            return False
        if name == "experts":
            if not entry.is_dir() or entry.is_symlink():
                return False
            if not all(LAYER_FILE.fullmatch(f.name) and f.is_file() for f in entry.iterdir()):
                return False
        elif entry.is_dir() or entry.is_symlink():
            return False
    return True


def check_replaceable(target: Path, source: Path, what: str) -> None:
    """Raise unless folder `target` may be deleted by a repack of checkpoint `source`. what: why it would be."""
    t, s = target.resolve(), source.resolve()
    if t == s or t in s.parents:
        raise StoreError(f"{target}: it {'is' if t == s else 'holds'} the source checkpoint {source}; give the store a folder "
                         "of its own")
    if target.is_symlink() or not target.is_dir():
        raise StoreError(f"{target}: not a folder Sluice made ({what}); move it away or pick another name")
    if not store_like(target):
        raise StoreError(f"{target}: holds files that are not part of a Sluice store, so it is not replaced ({what}); "
                         "move it away or pick another name")
