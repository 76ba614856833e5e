"""model stage: the model's input kept by the CPU stage, and when it was kept

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("converted_at", sa.DateTime(), nullable=True))
    op.create_table(
        "model_input",
        sa.Column("email_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["email_id"], ["email_message.id"], name=op.f("fk_model_input_email_id_email_message")
        ),
        sa.PrimaryKeyConstraint("email_id", name=op.f("pk_model_input")),
    )


def downgrade() -> None:
    op.drop_table("model_input")
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.drop_column("converted_at")
