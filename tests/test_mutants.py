"""The mutation check's mutants (tests/mutants/run.py, docs/mutants.md) still apply, and name tests
that exist: a mutant whose line moved checks nothing, and its run only says so when it runs."""

from __future__ import annotations

import pytest

from tests.mutants.run import MUTANTS, REPO, Mutant


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_changes_exactly_one_place(mutant: Mutant) -> None:
    found = (REPO / mutant.path).read_text().count(mutant.old)
    assert found == 1, (
        f"{mutant.name}: its `old` text is found {found} times in {mutant.path}, where it must "
        "be found once, or the mutant checks nothing. The code changed: write the mutant's `old` "
        "and `new` in tests/mutants/run.py as the code reads now, so that it still makes the bug "
        f"it stands for ({mutant.why})."
    )


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_is_killed_by_tests_that_exist(mutant: Mutant) -> None:
    assert mutant.killed_by, f"{mutant.name} names no test that kills it"
    for test in mutant.killed_by:
        path, _, name = test.partition("::")
        function = name.partition("[")[0]  # a parametrized test's case: test_name[case]
        assert (REPO / path).is_file(), f"{mutant.name}: no file {path}"
        assert f"def {function}(" in (REPO / path).read_text(), f"{mutant.name}: no test {test}"
