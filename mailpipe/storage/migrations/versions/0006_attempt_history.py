"""attempt history: one row per attempt, a failed run's error class, and dismissed runs

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("error_class", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("dismissed_at", sa.DateTime(), nullable=True))
    op.create_table(
        "run_attempt",
        sa.Column("id", _ID, nullable=False),
        sa.Column("run_id", _ID, nullable=False),
        sa.Column("email_id", _ID, nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("error_class", sa.String(length=64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.ForeignKeyConstraint(
            ["email_id"], ["email_message.id"], name=op.f("fk_run_attempt_email_id_email_message")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["pipeline_run.id"], name=op.f("fk_run_attempt_run_id_pipeline_run")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_attempt")),
    )
    op.create_index("ix_run_attempt_email_id", "run_attempt", ["email_id", "id"])
    op.create_index("ix_run_attempt_ended_at", "run_attempt", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_run_attempt_ended_at", table_name="run_attempt")
    op.drop_index("ix_run_attempt_email_id", table_name="run_attempt")
    op.drop_table("run_attempt")
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.drop_column("dismissed_at")
        batch_op.drop_column("error_class")
