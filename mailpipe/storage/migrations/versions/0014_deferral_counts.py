"""deferral counts: a run's deferrals in a row of its history, and each lane's in its samples

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

Only adds two nullable columns. `run_attempt.deferrals`: how many deferrals in a row the
attempt's row stands for, counted up in place instead of a row each; NULL on a row of the
release before, which wrote one row per deferral (and on every row that is no deferral).
`queue_sample.deferred`: the lane's deferrals since the report before, for the console's charts;
NULL on a sample of the release before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("run_attempt", sa.Column("deferrals", sa.Integer(), nullable=True))
    op.add_column("queue_sample", sa.Column("deferred", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("queue_sample", "deferred")
    op.drop_column("run_attempt", "deferrals")
