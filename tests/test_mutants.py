"""The mutation check's mutants still apply: a mutant whose line moved checks nothing, and its
run only says so when it runs (tests/mutants/run.py, docs/mutants.md)."""

from __future__ import annotations

import pytest

from tests.mutants.run import MUTANTS, REPO


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_changes_exactly_one_place(mutant) -> None:  # type: ignore[no-untyped-def]
    assert (REPO / mutant.path).read_text().count(mutant.old) == 1, mutant.why
