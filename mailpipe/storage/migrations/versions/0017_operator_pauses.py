"""operator pauses: an operator's pause of a stage is kept in the database

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07

Only adds a table, `operator_pause`: one row per stage an operator paused, with the reason and
since when. Redis still holds the pause the workers read; the row is what puts it back after a
flushed or restarted Redis. The release before never reads the table: its operator's pauses are
in Redis only, as they were.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "operator_pause",
        sa.Column("stage", sa.String(16), primary_key=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("operator_pause")
