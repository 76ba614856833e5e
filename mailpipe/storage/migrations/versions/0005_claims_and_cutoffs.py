"""claims and cut-offs: a fence token that only grows, and the attempts shutdowns cut off

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("claims", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
        batch_op.add_column(
            sa.Column("cutoffs", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
    # A run's attempts so far were its claims: every later claim then gets a larger number.
    op.execute("UPDATE pipeline_run SET claims = attempts")


def downgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.drop_column("cutoffs")
        batch_op.drop_column("claims")
