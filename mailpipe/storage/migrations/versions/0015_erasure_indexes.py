"""erasure indexes: what deleting an email, its run and its origin look up (`mailpipe forget`)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05

Only indexes, built concurrently on PostgreSQL. Deleting a row makes PostgreSQL look for the rows
that refer to it, and without an index on the referring column that is a pass over its table
per row deleted: forgetting 10,000 emails among 200,000 ran past the statement timeout on
`email_message.origin_id` alone (docs/decisions/erasure.md). `email_message.origin_id` is
partial (not null): an email gets it from its first job, so ingest writes no entry.

A concurrent build that fails (a lost connection, a deadlock) leaves an invalid index behind,
which `IF NOT EXISTS` would keep: drop it (`DROP INDEX CONCURRENTLY <name>`) and run
`mailpipe db upgrade` again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# (name, table, column, partial index predicate)
_INDEXES = [
    ("ix_email_message_origin_id", "email_message", "origin_id", "origin_id IS NOT NULL"),
    ("ix_email_origin_first_email_id", "email_origin", "first_email_id", None),
    ("ix_run_attempt_run_id", "run_attempt", "run_id", None),
    ("ix_classification_email_id", "classification", "email_id", None),
]


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        for name, table, column, where in _INDEXES:
            op.create_index(name, table, [column], sqlite_where=_where(where))
        return
    # CONCURRENTLY cannot run inside a transaction.
    with op.get_context().autocommit_block():
        for name, table, column, where in _INDEXES:
            op.create_index(
                name,
                table,
                [column],
                postgresql_where=_where(where),
                postgresql_concurrently=True,
                if_not_exists=True,
            )


def downgrade() -> None:
    for name, *_ in reversed(_INDEXES):
        op.drop_index(name, if_exists=True)


def _where(predicate: str | None) -> sa.TextClause | None:
    return None if predicate is None else sa.text(predicate)
