"""The README's test command (`.ci/test`, which CI runs as written on every change) on a machine
that lacks what the suite drives and cannot install it: it stops before the suite, exit 3,
naming what to install. The interpreter and the venv's programs are stand-ins that record their
arguments, so the script runs as written without installing anything."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support.paths import REPO

PYTHON = """#!/bin/sh
/bin/mkdir -p .venv/bin
printf '#!/bin/sh\\necho "$0 $*" >> calls\\n' > .venv/bin/pip
printf '#!/bin/sh\\necho "$0 $*" >> calls\\n' > .venv/bin/pytest
/bin/chmod +x .venv/bin/pip .venv/bin/pytest
"""


def run_test_command(tmp_path: Path, *programs: str) -> subprocess.CompletedProcess[str]:
    """`.ci/test -q` in a checkout of its own, with only `programs` (and the stand-in python3)
    on PATH."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "test", tmp_path / ".ci" / "test")
    path = tmp_path / "path"
    path.mkdir()
    (path / "python3").write_text(PYTHON)
    (path / "python3").chmod(0o755)
    for program in ("dirname", "id", *programs):
        found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/bin:/bin")
        assert found is not None, program
        (path / program).symlink_to(found)
    return subprocess.run(
        ["/bin/bash", ".ci/test", "-q"],
        cwd=tmp_path,
        env={"PATH": str(path)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_chromium_or_a_way_to_install_it_the_suite_does_not_start(tmp_path: Path) -> None:
    done = run_test_command(tmp_path)
    assert done.returncode == 3, done.stderr
    assert "chromium" in done.stderr
    assert "apt-get install -y chromium" in done.stderr
    assert "pytest" not in (tmp_path / "calls").read_text()


def test_with_what_the_suite_drives_it_installs_the_project_and_runs_the_suite(
    tmp_path: Path,
) -> None:
    done = run_test_command(tmp_path, "chromium", "pgbouncer")
    assert done.returncode == 0, done.stderr
    pip, pytest = (tmp_path / "calls").read_text().splitlines()
    assert pip.endswith("pip install --quiet -e .[test]")
    assert pytest.endswith("pytest -q")
