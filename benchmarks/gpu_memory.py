"""The peak GPU memory a process used, as nvidia-smi sees the device: the one figure that counts a whole process (its
CUDA context, a peer's own allocator) the same way for Sluice and for llama.cpp."""

from __future__ import annotations

import shutil
import subprocess
import threading


class PeakMemory:
    """`with PeakMemory(gpu) as peak: run()`, then `peak.bytes`: the most memory used on the device during the block,
    less what was used when it began (None where nvidia-smi is missing). A reader thread follows nvidia-smi's
    sampling loop (every `period_ms`)."""

    def __init__(self, gpu: int = 0, period_ms: int = 100):
        self.gpu, self.period_ms = gpu, period_ms
        self.bytes: int | None = None

    def _used(self) -> int | None:
        out = subprocess.run(["nvidia-smi", "-i", str(self.gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True)
        return int(out.stdout.split()[0]) << 20 if out.returncode == 0 and out.stdout.strip() else None

    def __enter__(self) -> "PeakMemory":
        self.bytes = None
        if shutil.which("nvidia-smi") is None or (base := self._used()) is None:
            self._proc = None
            return self
        self._base, self._max = base, base
        self._proc = subprocess.Popen(["nvidia-smi", "-i", str(self.gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       f"-lms={self.period_ms}"], stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._follow, daemon=True)
        self._reader.start()
        return self

    def _follow(self) -> None:
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self._max = max(self._max, int(line) << 20)

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._reader.join(timeout=2)
        self.bytes = self._max - self._base
