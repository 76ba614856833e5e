"""Migrations only add (docs/decisions/message-compatibility.md): the previous release runs on
the schema this release migrates to, for the minutes of a rolling deploy and after a rollback.

Each migration's PostgreSQL DDL, as Alembic renders it offline, is read statement by statement.
A drop, a rename, a column tightened (NOT NULL, a new type), a NOT NULL column added without a
default, or an index on an existing table built without CONCURRENTLY fails here, unless the
migration was released before this rule (`BEFORE_THE_RULE`, each with why it was safe then).
"""

from __future__ import annotations

import io
import re

import pytest
from alembic import command
from alembic.script import ScriptDirectory

from mailpipe.storage.migrate import alembic_config

CONFIG_URL = "postgresql+psycopg://offline@localhost/offline"

FORBIDDEN = {
    "drops": re.compile(r"\bDROP\s+(TABLE|COLUMN|CONSTRAINT|INDEX|TYPE|VIEW)\b"),
    "renames": re.compile(r"\bRENAME\b"),
    "tightens a column": re.compile(r"\bALTER\s+COLUMN\s+\S+\s+(SET\s+NOT\s+NULL|TYPE)\b"),
}
ADD_CONSTRAINT = re.compile(r"\bALTER\s+TABLE\s+(\w+)\s+ADD\s+CONSTRAINT\b")
ADD_COLUMN = re.compile(r"\bADD\s+COLUMN\b")
CREATE_TABLE = re.compile(r"\bCREATE\s+TABLE\s+(\w+)")
CREATE_INDEX = re.compile(
    r"\bCREATE\s+(?:UNIQUE\s+)?INDEX\s+(CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?\S+\s+ON\s+(\w+)"
)

# Released while every deploy stopped the old workers first; none of them drops or tightens.
BEFORE_THE_RULE = {
    "0007": "two partial indexes on pipeline_run, built in place: a short lock, no release beside",
    "0008": "a partial index on pipeline_run, built in place: a short lock, no release beside",
}


def revisions() -> list[tuple[str, str]]:
    script = ScriptDirectory.from_config(alembic_config(CONFIG_URL))
    walked = list(script.walk_revisions("base", "heads"))
    return [(r.down_revision or "base", r.revision) for r in reversed(walked)]  # type: ignore[misc]


def statements(down: str, up: str) -> list[str]:
    config = alembic_config(CONFIG_URL)
    buffer = io.StringIO()
    config.output_buffer = buffer
    start = "" if down == "base" else f"{down}:"
    command.upgrade(config, f"{start}{up}", sql=True)
    text = re.sub(r"--[^\n]*", "", buffer.getvalue())
    return [" ".join(s.split()) for s in text.split(";") if s.strip()]


def breaches(sql: list[str]) -> list[str]:
    created = {m.group(1) for s in sql if (m := CREATE_TABLE.search(s))}
    found = []
    for statement in sql:
        found += [f"{what}: {statement}" for what, rx in FORBIDDEN.items() if rx.search(statement)]
        if ADD_COLUMN.search(statement) and "NOT NULL" in statement and "DEFAULT" not in statement:
            found.append(f"adds a NOT NULL column without a default: {statement}")
        constraint = ADD_CONSTRAINT.search(statement)
        if constraint and constraint.group(1) not in created:
            found.append(f"adds a constraint to an existing table: {statement}")
        index = CREATE_INDEX.search(statement)
        if index and not index.group(1) and index.group(2) not in created:
            found.append(f"builds an index on an existing table in place: {statement}")
    return found


@pytest.mark.parametrize(("down", "up"), revisions(), ids=lambda r: r)
def test_a_migration_only_adds(down: str, up: str) -> None:
    found = breaches(statements(down, up))
    if up in BEFORE_THE_RULE:
        assert found, f"{up} is listed as released before the rule but breaks none: unlist it"
        return
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("statement", "what"),
    [
        ("ALTER TABLE pipeline_run DROP COLUMN error", "drops"),
        ("DROP TABLE sweep_report", "drops"),
        ("ALTER TABLE email_message RENAME COLUMN lane TO queue_lane", "renames"),
        ("ALTER TABLE email_message ALTER COLUMN subject SET NOT NULL", "tightens a column"),
        ("ALTER TABLE email_message ALTER COLUMN size TYPE INTEGER", "tightens a column"),
        ("ALTER TABLE email_message ADD COLUMN tenant VARCHAR(8) NOT NULL", "without a default"),
        ("CREATE INDEX ix_run_lane ON pipeline_run (lane)", "in place"),
        ("CREATE INDEX IF NOT EXISTS ix_run_lane ON pipeline_run (lane)", "in place"),
        ("ALTER TABLE email_message ADD CONSTRAINT ck_size CHECK (size > 0)", "constraint"),
    ],
)
def test_the_rule_catches_each_kind_of_breach(statement: str, what: str) -> None:
    [found] = breaches([statement])
    assert what in found


def test_what_only_adds_passes() -> None:
    assert not breaches(
        [
            "CREATE TABLE health_check (name VARCHAR(64) NOT NULL, PRIMARY KEY (name))",
            "CREATE INDEX ix_health ON health_check (name)",
            "ALTER TABLE email_message ADD COLUMN lane VARCHAR(8) DEFAULT 'live' NOT NULL",
            "ALTER TABLE email_message ADD COLUMN note TEXT",
            "CREATE INDEX CONCURRENTLY ix_run_lane ON pipeline_run (lane)",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_run_label ON pipeline_run (label)",
        ]
    )
