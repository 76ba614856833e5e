"""search indexes: what the email search reads (docs/decisions/search-indexes.md)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

Only indexes, built concurrently on PostgreSQL, where each takes the time a pass over its table
takes (seconds at a million emails) without holding up the workers' writes. No column: the
Message-ID is the origin's, read through the origin's first email and its copies, which
`email_message` already indexes. The words of the subject and the sender are GIN indexes of
PostgreSQL's full text, expressions written here as `models.subject_words` and
`models.sender_words` build them (a test holds the two equal); SQLite gets the plain indexes
alone and searches those two columns by scanning.

A concurrent build that fails (a lost connection, a deadlock) leaves an invalid index behind,
which `IF NOT EXISTS` would keep: drop it (`DROP INDEX CONCURRENTLY <name>`) and run
`mailpipe db upgrade` again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# (name, table, columns, partial index predicate): on both dialects.
_PLAIN = [
    ("ix_email_message_received_at", "email_message", ["received_at", "id"], None),
    ("ix_email_message_bulk", "email_message", ["id"], "lane = 'bulk'"),
    ("ix_email_origin_message_id", "email_origin", ["message_id"], "message_id IS NOT NULL"),
    ("ix_email_label_label", "email_label", ["label", "email_id"], None),
    ("ix_pipeline_run_status", "pipeline_run", ["status", "email_id"], None),
    ("ix_pipeline_run_dismissed", "pipeline_run", ["email_id"], "dismissed_at IS NOT NULL"),
    (
        "ix_pipeline_run_error_class",
        "pipeline_run",
        ["error_class", "email_id"],
        "error_class IS NOT NULL",
    ),
]
# (name, expression on email_message): full-text GIN indexes, PostgreSQL only.
_WORDS = [
    ("ix_email_message_subject_words", "to_tsvector('simple'::regconfig, subject)"),
    (
        "ix_email_message_sender_words",
        "to_tsvector('simple'::regconfig, sender || ' ' || translate(sender, '@<>', '   '))",
    ),
]


def upgrade() -> None:
    postgresql = op.get_context().dialect.name == "postgresql"
    if not postgresql:
        for name, table, columns, where in _PLAIN:
            op.create_index(name, table, columns, sqlite_where=_where(where))
        return
    # CONCURRENTLY cannot run inside a transaction.
    with op.get_context().autocommit_block():
        for name, table, columns, where in _PLAIN:
            op.create_index(
                name,
                table,
                columns,
                postgresql_where=_where(where),
                postgresql_concurrently=True,
                if_not_exists=True,
            )
        for name, words in _WORDS:
            op.create_index(
                name,
                "email_message",
                [sa.text(words)],
                postgresql_using="gin",
                postgresql_concurrently=True,
                if_not_exists=True,
            )


def downgrade() -> None:
    postgresql = op.get_context().dialect.name == "postgresql"
    names = [name for name, *_ in _PLAIN] + ([name for name, _ in _WORDS] if postgresql else [])
    for name in reversed(names):
        op.drop_index(name, if_exists=True)


def _where(predicate: str | None) -> sa.TextClause | None:
    return None if predicate is None else sa.text(predicate)
