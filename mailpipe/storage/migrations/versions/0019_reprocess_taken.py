"""reprocess taken: the runs a reprocess reopened, beside what its plan counted

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07

Only adds a nullable column. `reprocess.taken`: the runs the reprocess reopened, counted in the
transaction of each batch, so that its progress adds up when fewer were left to take than its
plan counted. NULL on a reprocess of the release before, whose progress reads `emails` instead.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reprocess", sa.Column("taken", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("reprocess", "taken")
