"""Sluice's structlog loggers: lines on stderr (stdout is for generated text), human-readable or JSON."""

from __future__ import annotations

import sys

import structlog

from sluice.errors import ConfigError

FORMATS = ("console", "json")  # console: a time, the event and key=value pairs; json: one JSON object a line


class _Stderr:
    """Whatever sys.stderr is at the time of writing (it may be replaced after import)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(log_format: str = "console", **bind):
    if log_format not in FORMATS:
        raise ConfigError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")
    if log_format == "json":
        stamp, render = structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.JSONRenderer()
    else:
        stamp, render = structlog.processors.TimeStamper(fmt="%H:%M:%S"), structlog.dev.ConsoleRenderer(colors=False)
    return structlog.wrap_logger(
        structlog.PrintLogger(_Stderr()),
        processors=[structlog.processors.add_log_level, stamp, render],
    ).bind(**bind)
