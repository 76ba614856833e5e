"""queue samples: each lane's depth and oldest job as the metrics report read them

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

Only adds: a table of its own with its index, built with it. The report writes a row per lane
and deletes those older than a day, so the table holds a day of reports (5,760 rows at the
default interval). The console's charts of attempts read `run_attempt` by the index on
`ended_at` that 0006 made; none is added to it (docs/benchmarks.md, "Activity charts").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "queue_sample",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("measured_at", sa.DateTime(), nullable=False),
        sa.Column("queue", sa.String(length=255), nullable=False),
        sa.Column("lane", sa.String(length=8), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("oldest_age_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_queue_sample")),
    )
    op.create_index("ix_queue_sample_measured_at", "queue_sample", ["measured_at"])


def downgrade() -> None:
    op.drop_index("ix_queue_sample_measured_at", table_name="queue_sample")
    op.drop_table("queue_sample")
