"""`pip install .` must carry every subpackage, the schedules and the console script."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contents(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("sluice-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ("pipeline", "stages", "kernels", "storage", "models", "schedules"):
        assert f"sluice/{pkg}/__init__.py" in names, pkg
    assert {"sluice/cli.py", "sluice/schedules/serial.yaml", "sluice/schedules/overlap.yaml", "sluice/kernels/cpu_native.c",
            "sluice/kernels/native/common.h", "sluice/kernels/native/fp4.c"} <= names  # the C unit and the parts it includes
    assert not any(n.startswith(("sluice/tests/", "sluice/.venv")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sluice = sluice.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
