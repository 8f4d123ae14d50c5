"""The mutation check in the default suite: one mutant of tests/mutants.py (the routed sum scaled by 1.001 in decode
only) against one golden test on a quick variant, in a copy of the package; the whole check is
`python tests/mutants.py` (minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

import mutants


def test_every_mutant_patch_applies_once():
    """Each mutant's text is in its file exactly once: a patch the code moved away from is an error, not a pass."""
    for name, m in mutants.MUTANTS.items():
        assert (mutants.ROOT / m.file).read_text().count(m.old) == 1, f"mutant {name!r}: its text moved out of {m.file}"
        assert m.tests and all("::" in t for t in m.tests), name


@pytest.mark.timeout(180)
def test_decode_scale_mutant_is_killed(tmp_path: Path):
    """A routed sum 0.1% off in one-token steps (prompts exact) fails the golden test of every decode step: the
    unmutated copy passes the same test, the mutated one fails it."""
    from concurrent.futures import ThreadPoolExecutor

    test = "tests/test_direct.py::test_direct_matches_transformers[mixtral]"  # no Mamba: the quickest reference
    copies = [mutants.make_copy(tmp_path / name, mutant) for name, mutant in (("clean", None), ("mutant", "scale-decode"))]
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side
        clean, bad = pool.map(lambda dest: mutants.run_tests(dest, (test,)), copies)
    assert clean == {test: "passed"}, clean
    assert bad == {test: "failed"}, bad
