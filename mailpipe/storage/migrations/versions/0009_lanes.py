"""lanes: the lane of each email's jobs, live unless stored as bulk

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("email_message", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("lane", sa.String(length=8), nullable=False, server_default=sa.text("'live'"))
        )


def downgrade() -> None:
    with op.batch_alter_table("email_message", schema=None) as batch_op:
        batch_op.drop_column("lane")
