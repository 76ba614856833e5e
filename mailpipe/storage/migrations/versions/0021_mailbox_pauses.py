"""mailbox pauses: an operator's pause of a mailbox is kept in the database

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-08

Only adds a table, `mailbox_pause`: one row per mailbox an operator paused (`mailpipe pause
--mailbox`), named as shown ("default" for the default mailbox), with the reason and since when.
Redis holds the pauses the workers read; the rows are what put them back after a flushed or
restarted Redis. The release before never reads the table, and holds no mailbox's jobs.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mailbox_pause",
        sa.Column("mailbox", sa.Text(), primary_key=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mailbox_pause")
