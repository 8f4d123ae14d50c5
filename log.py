"""Sluice's structlog logger: human-readable lines on stderr (stdout is for generated text)."""

from __future__ import annotations

import sys

import structlog


class _Stderr:
    """Whatever sys.stderr is at the time of writing (it may be replaced after import)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(**bind):
    return structlog.wrap_logger(
        structlog.PrintLogger(_Stderr()),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
    ).bind(**bind)
