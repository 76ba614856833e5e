"""The reference tables say what is: the README's roles table is the Procfile and its command
table names every command; docs/settings.md names every setting with its default;
docs/architecture.md's layout names every module where it is."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from pydantic import SecretStr

from mailpipe.settings import Settings
from tests.support.paths import REPO

README = REPO / "README.md"
SETTINGS = REPO / "docs" / "settings.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MIB = 1024 * 1024


def section(page: Path, title: str) -> str:
    return page.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def procfile() -> dict[str, str]:
    lines = (REPO / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if line.strip())


def test_the_roles_table_is_the_procfile() -> None:
    rows = re.findall(r"^\| (\w+) \| `([^|]*?)` \|", section(README, "Roles"), re.MULTILINE)
    assert dict(rows) == procfile()


def settings_rows() -> list[tuple[list[str], str]]:
    """Each row of the settings table: the variables it names, and its default cell."""
    rows = []
    for line in section(SETTINGS, "The settings").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) < 3 or not cells[0].startswith("`MAILPIPE_"):
            continue
        rows.append((re.findall(r"MAILPIPE_[A-Z0-9_*]+", cells[0]), cells[1]))
    return rows


def field(variable: str) -> str:
    return variable.removeprefix("MAILPIPE_").lower()


def test_the_settings_table_names_every_setting() -> None:
    named = {v for variables, _ in settings_rows() for v in variables}
    wildcards = [v[:-1] for v in named if v.endswith("*")]
    missing = [
        f"MAILPIPE_{name.upper()}"
        for name in Settings.model_fields
        if f"MAILPIPE_{name.upper()}" not in named
        and not any(f"MAILPIPE_{name.upper()}".startswith(w) for w in wildcards)
    ]
    assert missing == []
    unknown = [v for v in named if not v.endswith("*") and field(v) not in Settings.model_fields]
    assert unknown == []


def as_written(value: object) -> str | None:
    """A default as the table writes it, or None where the table describes it in words."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None or isinstance(value, SecretStr):
        return "unset"
    if isinstance(value, int | float):
        if value >= MIB and value % MIB == 0:
            return f"{value // MIB:g} MiB"
        return f"{value:g}"
    if value == "":
        return "empty"
    if isinstance(value, str) and len(value) < 40:
        return value
    return None


def written_defaults() -> list[tuple[str, str, str]]:
    """(variable, the table's default, the field's default as written) for every row whose
    default cell gives one value per variable."""
    pairs = []
    for variables, cell in settings_rows():
        values = [v.strip() for v in re.split(r",|/", cell.replace("`", ""))]
        if len(values) != len(variables) or any(v.endswith("*") for v in variables):
            continue
        for variable, value in zip(variables, values, strict=True):
            expected = as_written(Settings.model_fields[field(variable)].default)
            if expected is not None:
                pairs.append((variable, value.removesuffix(" s"), expected))
    return pairs


@pytest.mark.parametrize(("variable", "written", "default"), written_defaults())
def test_the_settings_table_gives_each_default(variable: str, written: str, default: str) -> None:
    assert written == default, (
        f"{variable}: docs/settings.md says {written}, the default is {default}"
    )


def test_most_defaults_are_checked() -> None:
    assert len(written_defaults()) >= 40


def layout() -> dict[str, set[str]]:
    """Each folder the layout names (a bullet's first span, its layer maybe in brackets after
    it), and the modules it names in it (`celeryconfig.py` is named beside `config.py`, which it
    re-exports)."""
    top = {"celeryconfig.py"}
    folders: dict[str, set[str]] = {}
    for bullet in section(ARCHITECTURE, "Layers").split("\n- ")[1:]:
        folder = re.match(r"`(mailpipe/[\w/]*)`(?: \([^)]*\))?:", bullet)
        if folder:
            modules = set(re.findall(r"`(\w+\.py)`", bullet)) - top
            folders.setdefault(folder.group(1), set()).update(modules)
    return folders


def test_the_command_table_names_every_command() -> None:
    from mailpipe.cli.main import main

    rows = section(README, "Command line").split("\n\n", 1)[0]
    first_cells = [row.split(" | ")[0] for row in rows.splitlines() if row.startswith("| `")]
    named = {
        name
        for cell in first_cells
        for name in re.findall(r"`mailpipe ([a-z-]+(?: [a-z]+)?)", cell)
    }
    commands = {
        f"{name} {sub}" if isinstance(command, click.Group) else name
        for name, command in main.commands.items()
        for sub in (command.commands if isinstance(command, click.Group) else [""])
    }
    # A row names its command then its arguments: keep of each row's words what is a command.
    named = {row if row in commands else row.split(" ")[0] for row in named}
    assert commands <= named, f"commands without a row: {sorted(commands - named)}"


def test_the_layout_names_every_module_in_its_folder() -> None:
    named = layout()
    package = REPO / "mailpipe"
    folders = {p.parent for p in package.rglob("*.py") if "migrations" not in p.parts}
    on_disk = {
        f"{folder.relative_to(REPO)}/": {p.name for p in folder.glob("*.py")} - {"__init__.py"}
        for folder in folders
    }
    assert named == on_disk
