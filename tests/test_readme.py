"""The README's commands run as written: every `.venv/bin/sluice` line parses with the CLI's own parser, and those that
need nothing outside the repository (the bundled model) run to success."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sluice.cli import _parser, main

README = Path(__file__).resolve().parent.parent / "README.md"
OUTSIDE = re.compile(r"(^|\s)(/models|/nvme|/tmp/|M\b|STORE\b|GGUF\b|BIN\b|run\.j)")  # a user's paths, placeholders


def readme_commands() -> list[list[str]]:
    lines = [line.split("#")[0].strip() for line in README.read_text().splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith(".venv/bin/sluice ")]


def test_the_readme_has_commands():
    assert len(readme_commands()) >= 10


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_each_command_parses(argv):
    args = _parser().parse_args(argv)
    assert getattr(args, "func", None) is not None


SELF_CONTAINED = [a for a in readme_commands() if not OUTSIDE.search(" ".join(a)) and a[0] in ("generate", "bench")]


def test_some_commands_are_self_contained():
    assert len(SELF_CONTAINED) >= 2


@pytest.mark.parametrize("argv", SELF_CONTAINED, ids=lambda a: " ".join(a)[:60])
def test_self_contained_commands_run(argv, capsys):
    argv = [*argv, "--device", "cpu"]
    if argv[0] == "generate":
        argv += ["--max-new-tokens", "4"]  # the text as written, shorter: the point is that it runs
    assert main(argv) == 0
    assert capsys.readouterr().out.strip()
