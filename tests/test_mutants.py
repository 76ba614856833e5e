"""The mutation check (tests/mutants/run.py, docs/mutants.md) within the suite: every mutant still
applies and names tests that exist, and the few mutants this commit samples are killed."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.mutants.run import MUTANTS, REPO, Mutant, run_mutant, verdict

# Five mutants a commit, picked by the commit's id: a commit always checks the same five, and
# each mutant is in about one commit's sample in six.
SAMPLE_SIZE = 5
# The id to pick by where git cannot tell the commit (a checkout without its history).
COMMIT_VARIABLE = "MUTANTS_COMMIT"
# Each sampled mutant's tests kill it in well under a minute; five, two at a time, stay within
# the suite's timeout of a test (pyproject.toml). A run cut off is no verdict, and fails the check.
MUTANT_TIMEOUT = 110


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


def commit() -> str:
    """The checkout's commit, from git, or from MUTANTS_COMMIT where git has none to tell."""
    git = subprocess.run(
        ["git", "rev-parse", "--verify", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    if git.returncode == 0:
        return git.stdout.strip()
    if given := os.environ.get(COMMIT_VARIABLE, "").strip():
        return given
    pytest.fail(
        f"the commit that picks the mutants to check cannot be read: `git rev-parse HEAD` says "
        f"{git.stderr.strip()!r}. Run in a git checkout, or set {COMMIT_VARIABLE} to the commit.",
        pytrace=False,
    )


def sample(commit: str) -> list[Mutant]:
    picked = random.Random(commit).sample(range(len(MUTANTS)), SAMPLE_SIZE)
    return [MUTANTS[i] for i in sorted(picked)]


def test_without_git_the_commit_comes_from_the_variable_or_the_sample_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout above it
    monkeypatch.delenv(COMMIT_VARIABLE, raising=False)
    with pytest.raises(pytest.fail.Exception, match=COMMIT_VARIABLE):
        commit()
    monkeypatch.setenv(COMMIT_VARIABLE, "0123abc")
    assert commit() == "0123abc"


@pytest.mark.parametrize(
    ("returncode", "killer", "message", "expected"),
    [
        (1, "tests/a.py::test_x", "assert 1 == 2", "killed"),
        (1, "tests/a.py::test_x", "AssertionError: timed out after 30s", "killed"),
        (0, "", "", "survived"),
        (1, "tests/a.py::test_x", "Failed", "killed"),  # pytest.raises saw nothing raised
        (1, "tests/a.py::test_x", "TypeError: unexpected keyword", "no verdict"),
        (1, "tests/a.py::test_x", "Timeout", "no verdict"),
        (1, "tests/a.py::test_y", "assert 1 == 2", "no verdict"),
        (2, "", "", "no verdict"),  # interrupted: a collection error
        (3, "", "", "no verdict"),  # services down
        (4, "", "", "no verdict"),  # usage: a case id that does not exist
        (5, "", "", "no verdict"),  # no test ran
    ],
)
def test_only_an_assertion_of_a_named_test_kills_a_mutant(
    returncode: int, killer: str, message: str, expected: str
) -> None:
    got = verdict(returncode, killer, message, named=("tests/a.py::test_x",))
    assert got.startswith(expected), got


def test_a_mutant_that_changes_nothing_pointed_at_a_missing_test_is_no_kill() -> None:
    """What the check once counted as a kill: a no-op mutant and a test id that does not exist."""
    nothing = Mutant("nothing", MUTANTS[0].path, MUTANTS[0].old, MUTANTS[0].old, "no change", ())
    missing = "tests/unit/test_errors.py::test_that_does_not_exist"
    result = run_mutant(nothing, ["-n", "0", missing], 60, named=(missing,))
    assert result["result"] != "killed", result


def test_a_commit_always_samples_the_same_mutants_and_commits_sample_them_all() -> None:
    assert sample("0" * 40) == sample("0" * 40)
    seen = {m.name for i in range(200) for m in sample(f"{i:040x}")}
    assert seen == {m.name for m in MUTANTS}


@pytest.mark.services
@pytest.mark.slow
def test_the_mutants_this_commit_samples_are_killed() -> None:
    """Each sampled mutant is written into a copy of the checkout and its `killed_by` tests run
    there, stopping at the first failure; the whole check runs them all (docs/mutants.md)."""
    chosen = sample(commit())
    started = time.monotonic()
    # Two at a time: most of a run is spent waiting on its workers, database and S3 server.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(
            pool.map(
                lambda m: run_mutant(
                    m, ["-n", "0", *m.killed_by], MUTANT_TIMEOUT, named=m.killed_by
                ),
                chosen,
            )
        )
    seconds = time.monotonic() - started
    report = "\n".join(
        f"  {r['name']}: {r['result']} in {r.get('seconds', 0)} s ({r.get('tests', '')})"
        for r in results
    )
    survivors = [r for r in results if r["result"] != "killed"]
    assert not survivors, (
        f"mutants not killed by their tests ({seconds:.0f} s in all):\n{report}\n"
        "A mutant survives when the code it changes has a bug its tests no longer catch, or "
        "when its `killed_by` tests no longer test that code; run the whole check with "
        "`python -m tests.mutants.run --only NAME`."
    )
