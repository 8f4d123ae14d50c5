"""The mutation check: bugs injected into a copy of the package must fail the tests written to catch them.

    .venv/bin/python tests/mutants.py                 # every mutant (minutes), each against its tests
    .venv/bin/python tests/mutants.py scale-decode    # one; `--list` names them; extra args after `--` go to pytest

Each mutant is a text patch on one file of a copy of the package (the working tree's package, unchanged here): its
`old` text must occur exactly once, so a patch that no longer applies (the code moved) says so instead of passing
as "killed". The copy is imported as `sluice` ahead of the editable install (PYTHONPATH); this working tree's tests
run against it. A mutant is killed when every test it names fails; the unmutated copy must pass the same tests first
(the control), so a failure is the mutant's and not the copy's. Not in the default suite (minutes): one mutant runs
there, tests/test_mutants.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root: the package `sluice`
TESTS = Path(__file__).resolve().parent
VARIANT_NAMES = ("nemotron_h", "nemotron_h_latent", "nemotron_h_groups", "qwen3_moe", "qwen3_next", "mixtral", "deepseek_v3",
                 "gpt_oss", "gpt_oss_unquantized", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v4")  # tests/common.py VARIANTS


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to the package root
    old: str  # text found exactly once in file
    new: str
    tests: tuple[str, ...]  # pytest node ids (relative to the repository root): each must fail
    why: str


def _golden(schedule: str = "overlap") -> tuple[str, ...]:
    return tuple(f"tests/test_golden.py::test_matches_transformers[{v}-{schedule}]" for v in VARIANT_NAMES)


MUTANTS = {
    # the routed sum off by 0.1% in one-token steps only: prompts stay exact, so only decode logits can tell
    "scale-decode": Mutant(
        "models/base.py",
        "        return residual_add(residual, self.finish(routed, x), shared)\n",
        "        return residual_add(residual, self.finish(routed * (1.001 if routed.shape[0] == 1 else 1.0), x), shared)\n",
        _golden() + tuple(f"tests/test_direct.py::test_direct_matches_transformers[{v}]" for v in VARIANT_NAMES),
        "routed-expert sum scaled by 1.001 in decode only"),
    # the expert of the smallest weight among a token's top-k dropped (weight 0) in one-token steps only
    "no-release": Mutant(
        "pipeline/whole.py",
        "                    for rest in turns[done:]:\n                        rest.release()\n",
        "                    pass\n",
        ("tests/test_host_wait.py::test_a_failed_turn_raises_the_flags_of_the_turns_left",),
        "a failed host turn leaves the graph's later waits unreleased: the replayed step would spin until its wait gives up"),
    "drop-last-decode": Mutant(
        "models/base.py",
        "    def guessed(self, x: torch.Tensor)",
        "    def __post_init__(self):\n"
        "        route = self.router\n"
        "        if getattr(route, 'dropped', False):\n"
        "            return\n\n"
        "        def dropped(x):\n"
        "            w, ids = route(x)\n"
        "            return (w.scatter(1, w.argmin(1, keepdim=True), 0.0) if ids.shape[0] == 1 else w), ids\n\n"
        "        dropped.dropped = True\n"
        "        object.__setattr__(self, 'router', dropped)\n\n"
        "    def guessed(self, x: torch.Tensor)",
        _golden() + tuple(f"tests/test_direct.py::test_direct_matches_transformers[{v}]" for v in VARIANT_NAMES),
        "the last-ranked (smallest-weight) routed expert dropped in decode only"),
    # repack writes expert 0's block where the last expert's goes and the other way round (checksums of what it
    # wrote: the store verifies clean)
    "swap-last-block": Mutant(
        "storage/repack.py",
        "block = build_block(ex.blocks[(layer, expert)], ex.slots, ex.block_bytes, fds)",
        "block = build_block(ex.blocks[(layer, {0: spec.num_experts - 1, spec.num_experts - 1: 0}.get(expert, expert))], "
        "ex.slots, ex.block_bytes, fds)",
        _golden(),
        "the last expert's block swapped with expert 0's in every layer of the store"),
    # the scalar tail of the n-major FP4 row (K/2 not a multiple of the vector step) reads the nibbles the wrong way
    "nibbles-tail-nmajor": Mutant(
        "kernels/native/fp4.c",
        "            part += e2m1(b & 15) * xe[j] + e2m1(b >> 4) * xo[j];",
        "            part += e2m1(b >> 4) * xe[j] + e2m1(b & 15) * xo[j];",
        ("tests/test_cpu_kernels.py::test_native_fp4_scalar_tail[nmajor-e4m3-24x40]",),
        "nibbles swapped in the n-major FP4 kernel's scalar tail (native/fp4.c fp4_row)"),
    # the scalar tail of the k-major FP4 rows (outputs not a multiple of the vector width) likewise
    "nibbles-tail-kmajor": Mutant(
        "kernels/native/fp4.c",
        "                    part[i] += e2m1(c & 15) * a + e2m1(c >> 4) * b;",
        "                    part[i] += e2m1(c >> 4) * a + e2m1(c & 15) * b;",
        tuple(f"tests/test_cpu_kernels.py::test_native_fp4_scalar_tail[kmajor-{s}]" for s in ("e4m3-13x16", "e8m0-13x32")),
        "nibbles swapped in the k-major FP4 kernel's scalar tail (native/fp4.c sluice_fp4_kmajor)"),
}


def _ignore(d: str, names: list[str]) -> list[str]:
    top = Path(d) == ROOT
    return [n for n in names if n in ("__pycache__", ".git", ".pytest_cache") or (top and n in (".venv", "tests", "docs", "build"))
            or (top and n.endswith(".egg-info")) or (Path(d) == ROOT / "models" and n == "default")]


def make_copy(dest: Path, mutant: str | None) -> Path:
    """A copy of the package at dest/sluice with `mutant`'s patch applied (None: unchanged); returns dest (the
    PYTHONPATH entry). models/default (the bundled model, tens of MB) is linked, not copied."""
    pkg = dest / "sluice"
    shutil.copytree(ROOT, pkg, ignore=_ignore, symlinks=True)
    if (ROOT / "models" / "default").exists():
        (pkg / "models" / "default").symlink_to(ROOT / "models" / "default")
    if mutant is not None:
        m = MUTANTS[mutant]
        path = pkg / m.file
        text = path.read_text()
        n = text.count(m.old)
        if n != 1:
            raise SystemExit(f"mutant {mutant!r}: its text occurs {n} times in {m.file} (the code moved: update the patch)")
        path.write_text(text.replace(m.old, m.new))
    return dest


def run_tests(dest: Path, tests: tuple[str, ...], pytest_args: list[str] = (), timeout: float | None = None) -> dict[str, str]:
    """Run `tests` with the copy at dest as `sluice`: node id -> passed | failed | skipped (the junit report's)."""
    report = dest / "report.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(dest), *filter(None, [os.environ.get("PYTHONPATH")])]),
               SLUICE_HOME=str(dest / "home"))
    check = subprocess.run([sys.executable, "-c", "import sluice; print(sluice.__file__)"], env=env, cwd=ROOT,
                           capture_output=True, text=True, check=True)
    assert Path(check.stdout.strip()).resolve().is_relative_to(dest.resolve()), f"sluice imported from {check.stdout}, not the copy"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit2", f"--junitxml={report}",
                    *pytest_args, *tests], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if not report.exists():
        raise RuntimeError("pytest wrote no report (a collection error?)")
    outcome = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        node = cls.replace(".", "/") + ".py::" + name  # tests.test_golden -> tests/test_golden.py
        kids = {c.tag for c in case}
        outcome[node] = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
    return outcome


def check(mutant: str, pytest_args: list[str] = (), control: bool = True) -> dict[str, str]:
    """Run mutant's tests against the unmutated copy (all must pass) and the mutated one (all must fail); returns the
    mutated run's outcomes; raises AssertionError naming the tests that let the mutant live."""
    tests = MUTANTS[mutant].tests
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant}-") as tmp:
        if control:
            clean = run_tests(make_copy(Path(tmp) / "clean", None), tests, pytest_args)
            bad = [t for t in tests if clean.get(t) != "passed"]
            assert not bad, f"control: without the mutant these do not pass: {bad} ({clean})"
        got = run_tests(make_copy(Path(tmp) / "mutant", mutant), tests, pytest_args)
    alive = [t for t in tests if got.get(t) != "failed"]
    assert not alive, f"mutant {mutant!r} ({MUTANTS[mutant].why}) survives: {alive}"
    return got


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mutants", nargs="*", help=f"of {', '.join(MUTANTS)} (default: all)")
    p.add_argument("--list", action="store_true", help="name each mutant and what it breaks")
    p.add_argument("--no-control", action="store_true", help="skip the unmutated run")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.list:
        for name, m in MUTANTS.items():
            print(f"{name}: {m.why} ({m.file}; {len(m.tests)} tests)")
        return 0
    failed = []
    for name in args.mutants or list(MUTANTS):
        try:
            check(name, extra, control=not args.no_control)
            print(f"killed   {name}: all {len(MUTANTS[name].tests)} tests fail")
        except AssertionError as e:
            failed.append(name)
            print(f"ALIVE    {name}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
