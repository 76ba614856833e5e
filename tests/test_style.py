"""The code's style and types, checked as CI checks them: ruff's lint and format on the code and
the tests, and mypy on the package (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

BIN = Path(sys.executable).parent
CHECKED = ["mailpipe", "tests", "bench"]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    result = run(str(BIN / "ruff"), "check", *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    result = run(str(BIN / "ruff"), "format", "--check", *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_no_type_error_in_the_package() -> None:
    result = run(str(BIN / "mypy"))
    assert result.returncode == 0, result.stdout + result.stderr
