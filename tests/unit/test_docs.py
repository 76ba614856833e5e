"""Every measured figure in docs/ says where it comes from: a section of a page in docs/ (the
decision records aside) whose table holds measured numbers names the command that produces them
and the commit they were measured at, a commit this repository has. And every file the README,
a page of docs/ or the package's docstrings and comments name is one the repository has."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
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


def cat_file(objects: list[str]) -> list[str]:
    """What `git cat-file --batch-check` answers for each object name, in one call."""
    result = subprocess.run(
        ["git", "cat-file", "--batch-check"],
        cwd=REPO,
        input="".join(f"{o}\n" for o in objects),
        capture_output=True,
        text=True,
        check=True,
    )
    answers = result.stdout.splitlines()
    assert len(answers) == len(objects), result.stdout
    return answers


def commits(names: set[str]) -> dict[str, bool]:
    """Whether git knows each name as a commit."""
    ordered = sorted(names)
    answers = cat_file([f"{n}^{{commit}}" for n in ordered])
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
    assert pages >= {"benchmarks.md", "scaling.md", "sweeper.md", "mutants.md"}
    assert len(MEASURED) >= 20


def test_the_rule_leaves_reference_tables_alone() -> None:
    """Tables of settings, metrics and what a field means hold numbers that are values set, not
    figures measured."""
    reference = {(s.page, s.title) for s in ALL_SECTIONS if s.tables and not measured_rows(s)}
    assert {
        ("metrics.md", "The metrics"),
        ("settings.md", "The settings"),
        ("operations.md", "The windows"),
        ("chaos.md", "The report"),
        ("lanes.md", "Queues"),
    } <= reference


def test_each_exception_is_a_section_the_rule_would_hold_to_it() -> None:
    tripping = {(s.page, s.title) for s in ALL_SECTIONS if measured_rows(s)}
    assert set(EXCEPTIONS) <= tripping


# A path from the repository's root, as the docs and comments write one: a top folder, then
# what follows up to the first character no path has (a placeholder's `<`, a glob's `*`, a test
# id's `::`). Not within a longer path or a URL (`github.com/owner/mailpipe/blob/...`). A top
# folder and one word with no dot and no slash after it is a unit (`docs/s`), not a path.
TOP_FOLDERS = ("bench", "deploy", "docs", "mailpipe", "tests")
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_FOLDERS)})/[\w./-]*)")
UNIT_LIKE = re.compile(r"[a-z]+/\w+")
# A Markdown link to a file of the repository, written from the page's own folder.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
# A file kept in git only, named with the commit that has it.
IN_GIT = re.compile(r"git show ([0-9a-f]{7,40}):([\w./-]+)")


def python_prose(path: Path) -> str:
    """A module's docstrings (the module's, each class's and function's) and its comments."""
    source = path.read_text()
    tree = ast.parse(source)
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = [ast.get_docstring(n) or "" for n in ast.walk(tree) if isinstance(n, documented)]
    comments = [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    return "\n".join(docstrings + comments)


def prose() -> dict[Path, str]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    modules = sorted((REPO / "mailpipe").rglob("*.py"))
    return {p: p.read_text() for p in pages} | {p: python_prose(p) for p in modules}


def named_paths(path: Path, text: str) -> set[str]:
    """The repository's paths the text names, from the root; a Markdown page's links too."""
    named = {m.rstrip(".") for m in REPO_PATH.findall(text)}
    named = {n for n in named if not UNIT_LIKE.fullmatch(n)}
    if path.suffix == ".md":
        for target in LINK.findall(text):
            if "://" not in target and not target.startswith("mailto:"):
                named.add(str((path.parent / target).resolve().relative_to(REPO)))
    return named


def in_git(names: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (commit, path) pairs git has."""
    ordered = sorted(names)
    answers = cat_file([f"{sha}:{path}" for sha, path in ordered])
    return {pair for pair, a in zip(ordered, answers, strict=True) if not a.endswith(" missing")}


def test_every_file_the_docs_and_comments_name_exists() -> None:
    """A file named is in the repository, or, removed, named with a commit that has it
    (`git show 3617760:bench/imports.py`) in the same text."""
    texts = prose()
    kept = {(p, pair) for p, text in texts.items() for pair in IN_GIT.findall(text)}
    found = in_git({pair for _, pair in kept})
    in_git_only = {(p, name) for p, (sha, name) in kept if (sha, name) in found}
    missing = sorted(
        f"{path.relative_to(REPO)}: {name}"
        for path, text in texts.items()
        for name in named_paths(path, text)
        if not (REPO / name).exists() and (path, name) not in in_git_only
    )
    assert missing == [], "paths named that the repository does not have:\n" + "\n".join(missing)


def test_the_path_rule_finds_the_paths() -> None:
    """A pattern that matched nothing would pass every page."""
    named = {n for path, text in prose().items() for n in named_paths(path, text)}
    assert {"docs/architecture.md", "mailpipe/errors.py", "deploy/README.md"} <= named
    assert "docs/decisions/web-framework.md" in named  # a link from docs/decisions/README.md
    assert len(named) >= 100
