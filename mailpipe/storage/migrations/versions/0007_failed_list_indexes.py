"""failed list indexes: the listed failed runs (not dismissed), newest first, by error class too

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_LISTED = "status = 'failed' AND dismissed_at IS NULL"


def upgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.create_index(
            "ix_pipeline_run_listed",
            ["closed_at", "id"],
            unique=False,
            postgresql_where=sa.text(_LISTED),
            sqlite_where=sa.text(_LISTED),
        )
        batch_op.create_index(
            "ix_pipeline_run_listed_class",
            ["error_class", "closed_at", "id"],
            unique=False,
            postgresql_where=sa.text(_LISTED),
            sqlite_where=sa.text(_LISTED),
        )


def downgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.drop_index("ix_pipeline_run_listed_class")
        batch_op.drop_index("ix_pipeline_run_listed")
