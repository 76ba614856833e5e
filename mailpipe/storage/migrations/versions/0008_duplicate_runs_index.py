"""duplicate runs index: the overview counts duplicate runs from it, up to where it estimates

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_DUPLICATE = "status = 'duplicate'"


def upgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.create_index(
            "ix_pipeline_run_duplicate",
            ["id"],
            unique=False,
            postgresql_where=sa.text(_DUPLICATE),
            sqlite_where=sa.text(_DUPLICATE),
        )


def downgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.drop_index("ix_pipeline_run_duplicate")
