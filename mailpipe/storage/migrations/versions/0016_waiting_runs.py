"""waiting runs: a run waiting for model calls is told from one whose job was lost

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07

Only adds two nullable columns. `pipeline_run.waiting_since`: since when the run, past its CPU
stage, waits for model calls; the sweep that starts its model stage once they are on counts no
re-add for it. NULL on every run of the release before, which the sweep then treats as it did.
`sweep_report.started_waiting`: how many such runs a sweep started; NULL on a report of the
release before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pipeline_run", sa.Column("waiting_since", sa.DateTime(), nullable=True))
    op.add_column("sweep_report", sa.Column("started_waiting", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("sweep_report", "started_waiting")
    op.drop_column("pipeline_run", "waiting_since")
