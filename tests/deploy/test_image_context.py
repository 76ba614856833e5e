"""The image's build context holds every file the Dockerfile copies.

`deploy/Dockerfile.dockerignore` is an allow list: whatever it does not let in is not in the build
context, and a COPY of it fails the build ("not found"). docker-py's `exclude_paths` applies
Docker's own .dockerignore rules (the `**` and `!` semantics of moby's patternmatcher) to the
checkout, and every COPY source of the Dockerfile must be in what it lets through. Offline: no
Docker engine is needed.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def ignore_patterns(text: str | None = None) -> list[str]:
    text = DOCKERIGNORE.read_text() if text is None else text
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def build_context(patterns: list[str]) -> set[str]:
    """The paths (files and folders, relative, '/'-separated) Docker sends as the context."""
    return set(exclude_paths(str(ROOT), patterns, dockerfile="deploy/Dockerfile"))


def copy_sources(dockerfile: str | None = None) -> list[str]:
    """The context paths the Dockerfile's COPY and ADD instructions read (not --from stages)."""
    text = DOCKERFILE.read_text() if dockerfile is None else dockerfile
    sources = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() not in ("COPY", "ADD"):
            continue
        args = [a for a in rest.split() if not a.startswith("--")]
        if any(a.startswith("--from") for a in rest.split()):
            continue
        sources.extend(args[:-1])
    return sources


def missing_sources(sources: list[str], context: set[str]) -> list[str]:
    missing = []
    for source in sources:
        source = source.removeprefix("./").rstrip("/")
        if any(ch in source for ch in "*?["):
            if not fnmatch.filter(context, source):
                missing.append(source)
        elif source not in context:
            missing.append(source)
    return missing


def test_every_copy_source_is_in_the_build_context():
    sources = copy_sources()
    assert {"requirements.lock", "pyproject.toml", "mailpipe", "mailpipe/app/flowerconfig.py"} <= {
        s.rstrip("/") for s in sources
    }
    assert missing_sources(sources, build_context(ignore_patterns())) == []


def test_the_package_goes_in_whole_and_nothing_else():
    context = build_context(ignore_patterns())
    package = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "mailpipe").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".pyo"))
    }
    # Package data (migrations' template, rules, demo emails) included, caches left out.
    assert package <= context
    assert not [p for p in context if "__pycache__" in p or p.endswith(".pyc")]
    top = {p.split("/", 1)[0] for p in context}
    # deploy/Dockerfile is always sent by Docker; no tests, .git, .venv, var/ or .env.
    assert top == {"mailpipe", "pyproject.toml", "README.md", "requirements.lock", "deploy"}
    assert {p for p in context if p.startswith("deploy")} == {"deploy/Dockerfile"}


@pytest.mark.parametrize(
    ("dockerfile", "patterns", "missing"),
    [
        # A file the allow list does not name.
        ("COPY flowerconfig.py /etc/x.py\n", None, ["flowerconfig.py"]),
        # The package folder dropped from the allow list.
        ("COPY mailpipe ./mailpipe\n", ["*", "!pyproject.toml"], ["mailpipe"]),
        # A file inside the package excluded by a later pattern.
        (
            "COPY mailpipe/app/flowerconfig.py /etc/x.py\n",
            ["*", "!mailpipe/", "mailpipe/app/flowerconfig.py"],
            ["mailpipe/app/flowerconfig.py"],
        ),
        # A glob that matches nothing in the context.
        ("COPY pyproject.toml CHANGES.m[d] ./\n", None, ["CHANGES.m[d]"]),
    ],
)
def test_the_check_sees_a_copy_the_context_lacks(dockerfile, patterns, missing):
    """Guards the check above: a source the allow list keeps out is reported."""
    context = build_context(ignore_patterns() if patterns is None else patterns)
    assert missing_sources(copy_sources(dockerfile), context) == missing
