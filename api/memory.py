"""Giving freed host memory back: glibc keeps what Python, torch and the tokenizer free in its heaps.

A server's RSS otherwise climbs with every request of a new size (activations, tokenizer buffers, JSON bodies) and
with every thread that allocates (glibc gives each an arena of its own), well past what snapshots hold (the soak in
BENCHMARKS.md). So: at most two arenas (set once, before the server's threads start),
and `malloc_trim` whenever the engine worker goes idle, which returns the heaps' free pages to the system (a few
milliseconds, only when nothing waits). On a C library without these calls both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_ARENA_MAX = -8  # glibc's mallopt parameter number


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def limit_arenas(n: int = 2) -> None:
    """Allocate from at most n malloc arenas (threads share them; fewer heaps, less memory held free)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, n)


def trim() -> None:
    """Return the free pages of every malloc heap to the system."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
