"""Local image files a client may name (`file://` image URLs): only regular files under `--image-dir` folders.

None by default: a server reads no file a client names unless its operator listed the folders. The path is
resolved (symlinks, `..`) before the folder check; the file is opened without blocking (a FIFO cannot hang the
server) and must be a regular file within the size cap. Every refusal reads the same, so a client learns nothing
about which paths exist. Called in a worker thread: it blocks on the disk.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_IMAGE_BYTES = 32 << 20  # an encoded image larger than this is refused, whatever the file


@dataclass(frozen=True)
class ImageFiles:
    dirs: tuple[Path, ...] = ()  # resolved folders whose files (and their subfolders') may be read
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def of(cls, dirs) -> "ImageFiles":
        return cls(tuple(Path(d).resolve() for d in dirs or ()))

    def read(self, host: str, path: str) -> bytes | None:
        """The file's bytes, or None: not allowed, missing, not a regular file, or too large (told apart nowhere)."""
        if not self.dirs or host not in ("", "localhost"):
            return None
        try:
            real = Path(os.path.realpath(path))
        except (OSError, ValueError):
            return None
        if not any(real.is_relative_to(d) for d in self.dirs):
            return None
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except (OSError, ValueError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_bytes:
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(self.max_bytes + 1)
            return data if len(data) <= self.max_bytes else None
        except OSError:
            return None
        finally:
            os.close(fd)
