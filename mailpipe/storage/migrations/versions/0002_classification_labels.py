"""classification labels: what a later attempt syncs without calling the model again

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("classification", schema=None) as batch_op:
        batch_op.add_column(sa.Column("labels", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("classification", schema=None) as batch_op:
        batch_op.drop_column("labels")
