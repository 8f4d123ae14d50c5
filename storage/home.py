"""Where Sluice keeps what it makes: SLUICE_HOME (default ~/.cache/sluice) holds stores/ (repacked checkpoints),
models/ (generated test models) and build/ (the CPU kernel compiled on this machine)."""

from __future__ import annotations

import os
from pathlib import Path


def sluice_home() -> Path:
    return Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice"))
