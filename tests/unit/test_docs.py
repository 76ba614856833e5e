"""Every measured figure in docs/ says where it comes from: a section of a page in docs/ (the
decision records aside) whose table holds measured numbers names the command that produces them
and the commit they were measured at, a commit this repository has."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO

PAGES = sorted((REPO / "docs").glob("*.md"))

# A table is a reference, not a measurement, when a column is named `default` (settings) or its
# first column names one of these kinds (settings, metrics, roles, layers, states, formats,
# failures and the like), whose numbers are values set, not figures measured.
REFERENCE_KINDS = {
    "candidate",
    "failure",
    "field",
    "field (setting)",
    "format",
    "layer",
    "metric",
    "role",
    "setting",
    "stage",
    "status",
    "subject",
    "variable",
}

# (page, section): why its measured-looking table needs no command or commit.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("hostile-input.md", "Hostile input"): "the table of the parser's limits: values set in the "
    "settings and the pre-scan, not figures measured (a first column named `limit` also heads "
    "the measured table of model-calls.md, so the kind cannot tell them apart)",
}

# A measured number: a figure with its unit (`1.63 s`, `75 %`, `11.9 MiB`, `127.6 jobs/s`, a
# factor), a plain decimal (`0.902`), or a cell that is a count and nothing else (`378`, `2,000`).
UNIT = r"(?:\u00b5s|ms|s|MiB|GiB|KiB|MB|GB|KB|jobs/s|emails/s|calls/s|docs/s|MB/s|%|x|\u00d7)"
FIGURE = re.compile(rf"\d(?:[\d,]*\d)?(?:\.\d+)? ?{UNIT}(?![\w/])|\d+\.\d+")
COUNT = re.compile(r"[<>~]? ?\d[\d,]*(?:\.\d+)?")

# A command: the text of a code block (fenced or indented) or of a code span that starts so.
COMMANDS = (".venv/bin/", "bash ", "pytest", "python -m", "git worktree")
SHA = re.compile(r"[0-9a-f]{7,40}")
# A commit a command names: the checkout of a baseline, a file kept in git only.
NAMED_IN_GIT = re.compile(r"git (?:worktree add \S+|show) ([0-9a-f]{7,40})\b")
CODE_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass
class Section:
    page: str
    title: str
    prose: list[str]  # lines outside code blocks, tables' rows included
    code: list[str]  # lines of fenced and indented code blocks
    tables: list[list[list[str]]]  # each table's rows, each row's cells (header first)

    @property
    def name(self) -> str:
        return f"{self.page}, section {self.title!r}"


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def sections(path: Path) -> list[Section]:
    """The page cut at its `##` and `###` headings (the part before the first is named by the
    page's title); fenced code blocks are read as code, never as headings or tables."""
    found: list[Section] = []
    current = Section(path.name, "(top of the page)", [], [], [])
    fenced = False
    table: list[list[str]] | None = None
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            table = None
            continue
        if fenced or (
            line.startswith("    ") and table is None and not line.lstrip().startswith("|")
        ):
            current.code.append(line.strip())
            continue
        heading = re.match(r"(#{1,3}) (.+)", line)
        if heading:
            if heading.group(1) == "#":
                current.title = heading.group(2).strip()
            else:
                found.append(current)
                current = Section(path.name, heading.group(2).strip(), [], [], [])
            table = None
            continue
        if line.lstrip().startswith("|"):
            if table is None:
                table = []
                current.tables.append(table)
            if not re.fullmatch(r"\|?[\s:|-]+\|?", line.strip()):
                table.append(cells(line))
            current.prose.append(line)
            continue
        table = None
        current.prose.append(line)
    found.append(current)
    return found


def plain(cell: str) -> str:
    return cell.replace("**", "").replace("`", "").strip()


def is_reference(table: list[list[str]]) -> bool:
    header = [plain(c).lower() for c in table[0]]
    return "default" in header or header[0] in REFERENCE_KINDS


def measured(cell: str) -> bool:
    text = plain(cell)
    return bool(FIGURE.search(text) or COUNT.fullmatch(text))


def measured_rows(section: Section) -> list[list[str]]:
    return [
        row
        for table in section.tables
        if table and not is_reference(table)
        for row in table[1:]
        if any(measured(c) for c in row)
    ]


def spans(section: Section) -> list[str]:
    return [s.strip() for s in CODE_SPAN.findall("\n".join(section.prose))]


def commands(section: Section) -> list[str]:
    candidates = [line.removeprefix("$ ") for line in section.code] + spans(section)
    return [c for c in candidates if c.startswith(COMMANDS)]


def shas(section: Section) -> list[str]:
    return [s for s in spans(section) if SHA.fullmatch(s)]


ALL_SECTIONS = [s for page in PAGES for s in sections(page)]
MEASURED = [s for s in ALL_SECTIONS if measured_rows(s) and (s.page, s.title) not in EXCEPTIONS]


def commits(names: set[str]) -> dict[str, bool]:
    """Whether git knows each name as a commit, in one `git cat-file --batch-check`."""
    ordered = sorted(names)
    result = subprocess.run(
        ["git", "cat-file", "--batch-check"],
        cwd=REPO,
        input="".join(f"{n}^{{commit}}\n" for n in ordered),
        capture_output=True,
        text=True,
        check=True,
    )
    answers = result.stdout.splitlines()
    assert len(answers) == len(ordered), result.stdout
    return {n: a.split()[1:2] == ["commit"] for n, a in zip(ordered, answers, strict=True)}


@pytest.mark.parametrize("section", MEASURED, ids=lambda s: f"{s.page}::{s.title}")
def test_a_section_of_measured_figures_names_its_command_and_its_commit(section: Section) -> None:
    example = " | ".join(measured_rows(section)[0])
    assert commands(section), (
        f"{section.name} quotes measured figures (| {example} |) but no command that produces "
        f"them: an indented line or a code span starting with one of {', '.join(COMMANDS)}"
    )
    assert shas(section), (
        f"{section.name} quotes measured figures (| {example} |) but not the commit they were "
        "measured at: a short sha in backticks, e.g. measured at `5cfc510`"
    )


def named_in_git(section: Section) -> list[str]:
    return NAMED_IN_GIT.findall("\n".join(section.code + spans(section)))


def test_every_commit_a_page_cites_is_one_git_has() -> None:
    cited = {(s.name, sha) for s in ALL_SECTIONS for sha in shas(s) + named_in_git(s)}
    known = commits({sha for _, sha in cited})
    unknown = sorted(f"{name}: `{sha}`" for name, sha in cited if not known[sha])
    assert unknown == [], "commits git does not know (`git cat-file -e <sha>^{commit}`):\n" + (
        "\n".join(unknown)
    )


def test_the_rule_finds_the_measurements() -> None:
    """A parsing slip that found no table would pass every section; these pages hold
    measurements for certain."""
    pages = {s.page for s in MEASURED}
    assert pages >= {"benchmarks.md", "operations.md", "scaling.md", "sweeper.md", "mutants.md"}
    assert len(MEASURED) >= 20


def test_the_rule_leaves_reference_tables_alone() -> None:
    """Tables of settings, metrics and what a field means hold numbers that are values set, not
    figures measured."""
    reference = {(s.page, s.title) for s in ALL_SECTIONS if s.tables and not measured_rows(s)}
    assert {
        ("metrics.md", "The metrics"),
        ("metrics.md", "Settings"),
        ("operations.md", "The windows"),
        ("chaos.md", "The report"),
        ("lanes.md", "What an operator sets"),
    } <= reference


def test_each_exception_is_a_section_the_rule_would_hold_to_it() -> None:
    tripping = {(s.page, s.title) for s in ALL_SECTIONS if measured_rows(s)}
    assert set(EXCEPTIONS) <= tripping
