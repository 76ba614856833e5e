"""run reopened_at: when an ended run was last opened again

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07

Only adds a nullable column. `pipeline_run.reopened_at`: when an operator's retry, a reprocess or
the forgetting of the email a copy copied last opened the ended run again, so that its waiting
work is aged from then, not from when the email was stored (docs/mailboxes.md, "The mailboxes
with waiting work"). NULL on a run never reopened, and on one reopened by the release before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pipeline_run", sa.Column("reopened_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    op.drop_column("pipeline_run", "reopened_at")
