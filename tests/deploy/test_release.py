"""Every release can be named: a version, a CHANGELOG section, and the commit of the release
before it, which the rolling-deploy test installs (docs/decisions/message-compatibility.md)."""

from __future__ import annotations

import re
import subprocess
import tomllib

from tests.support.paths import REPO


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def previous_release() -> str:
    return (REPO / "deploy" / "previous-release").read_text().strip()


def test_the_changelog_has_a_section_for_this_release_naming_the_one_before() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## (\S+)$", changelog, re.MULTILINE)
    assert sections[0] == version()
    current = changelog.split(f"## {version()}\n", 1)[1].split("\n## ", 1)[0]
    assert previous_release() in current
    for part in ("For operators:", "Migrations:", "Messages:"):
        assert part in current


def test_the_previous_release_is_a_commit_of_this_history_with_a_lower_version() -> None:
    commit = previous_release()
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    ancestor = subprocess.run(
        ["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True
    )
    assert ancestor.returncode == 0, (
        f"deploy/previous-release names {commit}, which this clone's history lacks: "
        "fetch the full history (git fetch --unshallow)"
    )
    shown = subprocess.run(
        ["git", "show", f"{commit}:pyproject.toml"], cwd=REPO, capture_output=True, text=True
    )
    before = tomllib.loads(shown.stdout)["project"]["version"]
    assert tuple(map(int, before.split("."))) < tuple(map(int, version().split(".")))
