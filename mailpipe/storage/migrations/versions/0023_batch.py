"""model batches: the bulk lane's model calls through Bedrock batch inference

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07

Only adds two tables. `model_batch`: one row per batch inference job (its state, the job's ARN
and status, the keys of its input and output, its counts and times). `model_batch_record`: one
row per email whose model stage waits for a batch, with the batch it is in (NULL until one is
formed) and whether it was sent through real-time instead. The release before never reads
them; its workers call the model for every message of the bulk model queue as they always did.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "model_batch",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column(
            "state",
            sa.Enum(
                "forming",
                "submitted",
                "applying",
                "done",
                "ended",
                name="batch_state",
                create_constraint=True,
            ),
            nullable=False,
        ),
        sa.Column("job_arn", sa.Text(), nullable=True),
        sa.Column("job_status", sa.String(length=32), nullable=True),
        sa.Column("input_key", sa.Text(), nullable=False),
        sa.Column("output_key", sa.Text(), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("answered", sa.Integer(), nullable=True),
        sa.Column("unanswered", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("submitted_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_model_batch_state", "model_batch", ["state"])
    op.create_table(
        "model_batch_record",
        sa.Column(
            "email_id", _ID, sa.ForeignKey("email_message.id"), primary_key=True, nullable=False
        ),
        sa.Column("batch_id", _ID, sa.ForeignKey("model_batch.id"), nullable=True),
        sa.Column("realtime", sa.Boolean(), nullable=False),
        sa.Column("since", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_model_batch_record_batch_id", "model_batch_record", ["batch_id"])
    op.create_index("ix_model_batch_record_since", "model_batch_record", ["since"])


def downgrade() -> None:
    op.drop_table("model_batch_record")
    op.drop_table("model_batch")
    sa.Enum(name="batch_state").drop(op.get_bind(), checkfirst=True)
