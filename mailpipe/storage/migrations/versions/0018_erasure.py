"""erasure: a fence in the database, a reprocess's filter by name, email ids never given twice

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-08

Only adds, on PostgreSQL (docs/decisions/erasure.md):

- `forgotten_email`: one row per email being forgotten, written with its run's closing and kept
  as long as Redis keeps the fence, so that a fence outlives a Redis that restarts without its
  data. A table of its own, which the previous release neither reads nor writes.
- `reprocess.filters`: the names of the filter's fields (`["sender", "subject"]`), what the
  progress shows of it. This release writes `reprocess.search` empty, as a filter's values
  name an email's sender and subject; the previous release, which writes it, reads neither.

On SQLite, `email_message` is built again with AUTOINCREMENT, rows, indexes and keys as they
were: without it SQLite gives the highest id again once its email is deleted, and the next email
stored would be an email forgotten, fenced off. PostgreSQL's sequence never gives an id twice.
SQLite's rebuild drops and renames the table, which `PRAGMA foreign_keys` would refuse while
other tables refer to it: the migrations run with it off, and check every key before they commit
(mailpipe/storage/migrations/env.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "forgotten_email",
        sa.Column("email_id", sa.BigInteger(), nullable=False),
        sa.Column("forgotten_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("email_id", name=op.f("pk_forgotten_email")),
    )
    op.create_index("ix_forgotten_email_forgotten_at", "forgotten_email", ["forgotten_at"])
    op.add_column("reprocess", sa.Column("filters", sa.JSON(), nullable=True))
    if op.get_context().dialect.name == "sqlite":
        with op.batch_alter_table(
            "email_message", recreate="always", table_kwargs={"sqlite_autoincrement": True}
        ):
            pass


def downgrade() -> None:
    op.drop_column("reprocess", "filters")
    op.drop_index("ix_forgotten_email_forgotten_at", table_name="forgotten_email")
    op.drop_table("forgotten_email")
