"""mailbox: the mailbox an email was delivered to

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07

Only adds: a nullable column and an index built concurrently on PostgreSQL. `email_message.mailbox`
is set by upstream storage or `mailpipe ingest --mailbox`; NULL is the default mailbox, which the
previous release's rows all belong to. The index (partial: not null) serves what an operator does
by mailbox (find, forget, pause and resume, the mailboxes with the most waiting work).

A concurrent build that fails leaves an invalid index behind, which `IF NOT EXISTS` would keep:
drop it (`DROP INDEX CONCURRENTLY ix_email_message_mailbox`) and run `mailpipe db upgrade` again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_WHERE = sa.text("mailbox IS NOT NULL")


def upgrade() -> None:
    op.add_column("email_message", sa.Column("mailbox", sa.Text(), nullable=True))
    if op.get_context().dialect.name != "postgresql":
        op.create_index(
            "ix_email_message_mailbox", "email_message", ["mailbox", "id"], sqlite_where=_WHERE
        )
        return
    # CONCURRENTLY cannot run inside a transaction.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_email_message_mailbox",
            "email_message",
            ["mailbox", "id"],
            postgresql_where=_WHERE,
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    op.drop_index("ix_email_message_mailbox", if_exists=True)
    op.drop_column("email_message", "mailbox")
