"""mailpipe as an upstream service gets it: built into a wheel, installed, and imported in a
process of someone else's. Installing it adds no top-level module but `mailpipe`, `celery
report` shows only Celery's settings, and importing it changes nothing global."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, installed (without its dependencies, which this
    interpreter has) into a folder of its own."""
    root = tmp_path_factory.mktemp("wheel")
    # Built as pip builds it anywhere: in an isolated environment with pyproject.toml's
    # build-system requirements, not with whatever setuptools this interpreter happens to have.
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(root / "dist"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, f"the wheel did not build:\n{built.stdout}\n{built.stderr}"
    [wheel] = (root / "dist").glob("mailpipe-*.whl")
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return site


def run(site: Path, *args: str) -> str:
    """A process of upstream's own: the installed wheel first on its path, its working folder
    outside this checkout."""
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(site.parent)}
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=site.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_the_wheel_installs_mailpipe_and_nothing_beside_it(installed: Path) -> None:
    top_level = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info")}
    assert top_level - {"bin"} == {"mailpipe"}
    imported = run(installed, "-c", "import mailpipe, mailpipe.celery; print(mailpipe.__file__)")
    assert imported.startswith(str(installed))
    # The package's data came with it: the migrations, the default rules, the demo's emails.
    assert (installed / "mailpipe/storage/migrations/script.py.mako").is_file()
    assert (installed / "mailpipe/classifiers/default_rules.toml").is_file()
    assert len(list((installed / "mailpipe/cli/demo/emails").glob("*.eml"))) == 6


def test_celery_report_shows_only_celery_settings(installed: Path) -> None:
    report = run(installed, "-m", "celery", "-A", "mailpipe", "report")
    keys = {
        line.split(":", 1)[0].strip()
        for line in report.split("\n\n", 1)[1].splitlines()
        if line and not line.startswith(" ") and ":" in line
    }
    known = json.loads(
        run(
            installed,
            "-c",
            (
                "import json; from celery.app.defaults import flatten, NAMESPACES; "
                "print(json.dumps(sorted(key for key, _ in flatten(NAMESPACES))))"
            ),
        )
    )
    # deprecated_settings: Celery's own note of the old names in use (None here).
    assert keys and keys - {"deprecated_settings"} <= set(known), sorted(keys - set(known))
    assert "broker_transport_options" in keys and "task_acks_late" in keys


def test_importing_mailpipe_changes_nothing_global(installed: Path) -> None:
    probe = """
import json
import celery, celery.signals
from kombu.transport import TRANSPORT_ALIASES
aliases = dict(TRANSPORT_ALIASES)
current = celery.current_app._get_current_object()
receivers = {name: len(getattr(celery.signals, name).receivers) for name in celery.signals.__all__}
import mailpipe.enqueue, mailpipe.celery
print(json.dumps({
    "aliases": dict(TRANSPORT_ALIASES) == aliases,
    "current_app": celery.current_app._get_current_object() is current,
    "receivers": {name: len(getattr(celery.signals, name).receivers) for name in celery.signals.__all__} == receivers,
}))
"""
    assert json.loads(run(installed, "-c", probe)) == {
        "aliases": True,
        "current_app": True,
        "receivers": True,
    }
