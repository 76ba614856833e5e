"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runtime_flag",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_runtime_flag")),
    )
    op.create_table(
        "sweep_report",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("readded_no_run", sa.Integer(), nullable=False),
        sa.Column("readded_stalled", sa.Integer(), nullable=False),
        sa.Column("skipped_queued", sa.Integer(), nullable=False),
        sa.Column("marked_for_review", sa.Integer(), nullable=False),
        sa.Column("queue_depth", sa.Integer(), nullable=True),
        sa.Column("backlog_per_task", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_report")),
    )
    op.create_table(
        "email_message",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("blob_key", sa.String(length=255), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("needs_review", sa.Boolean(), server_default=sa.text("(false)"), nullable=False),
        sa.Column("review_reason", sa.Text(), nullable=True),
        sa.Column("origin_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column(
            "duplicate_of", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("subject", sa.Text(), nullable=True),
        sa.Column("sender", sa.Text(), nullable=True),
        sa.Column("has_run", sa.Boolean(), server_default=sa.text("(false)"), nullable=False),
        sa.ForeignKeyConstraint(
            ["duplicate_of"],
            ["email_message.id"],
            name=op.f("fk_email_message_duplicate_of_email_message"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_email_message")),
    )
    with op.batch_alter_table("email_message", schema=None) as batch_op:
        batch_op.create_index("ix_email_message_duplicate_of", ["duplicate_of"], unique=False)
        batch_op.create_index(
            "ix_email_message_needs_review",
            ["id"],
            unique=False,
            postgresql_where=sa.text("needs_review"),
            sqlite_where=sa.text("needs_review"),
        )
        batch_op.create_index(
            "ix_email_message_no_run",
            ["id"],
            unique=False,
            postgresql_where=sa.text("NOT has_run"),
            sqlite_where=sa.text("NOT has_run"),
        )

    op.create_table(
        "email_origin",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=True),
        sa.Column(
            "first_email_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["first_email_id"], ["email_message.id"], name="fk_email_origin_first_email"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_email_origin")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_email_origin_fingerprint")),
    )
    # email_message and email_origin point at each other: the second link comes once both exist.
    with op.batch_alter_table("email_message", schema=None) as batch_op:
        batch_op.create_foreign_key(
            op.f("fk_email_message_origin_id_email_origin"), "email_origin", ["origin_id"], ["id"]
        )

    op.create_table(
        "document",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("email_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("part_index", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("content_type", sa.String(length=255), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "converted",
                "unsupported",
                "too_large",
                "failed",
                name="document_status",
                create_constraint=True,
            ),
            nullable=False,
        ),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("text_blob_key", sa.String(length=255), nullable=True),
        sa.Column("page_count", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["email_id"], ["email_message.id"], name=op.f("fk_document_email_id_email_message")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_document")),
        sa.UniqueConstraint("email_id", "part_index", name=op.f("uq_document_email_id")),
    )
    op.create_table(
        "email_label",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("email_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("label", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("confidence", sa.Double(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["email_id"], ["email_message.id"], name=op.f("fk_email_label_email_id_email_message")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_email_label")),
        sa.UniqueConstraint("email_id", "label", name=op.f("uq_email_label_email_id")),
    )
    op.create_table(
        "pipeline_run",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("email_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "open",
                "succeeded",
                "duplicate",
                "failed",
                name="run_status",
                create_constraint=True,
            ),
            nullable=False,
        ),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("attempt_started_at", sa.DateTime(), nullable=True),
        sa.Column("sweep_count", sa.Integer(), nullable=False),
        sa.Column("last_swept_at", sa.DateTime(), nullable=True),
        sa.Column("classified_at", sa.DateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["email_id"], ["email_message.id"], name=op.f("fk_pipeline_run_email_id_email_message")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pipeline_run")),
        sa.UniqueConstraint("email_id", name=op.f("uq_pipeline_run_email_id")),
    )
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.create_index(
            "ix_pipeline_run_failed",
            ["closed_at"],
            unique=False,
            postgresql_where=sa.text("status = 'failed'"),
            sqlite_where=sa.text("status = 'failed'"),
        )
        batch_op.create_index(
            "ix_pipeline_run_open",
            ["id"],
            unique=False,
            postgresql_where=sa.text("status = 'open'"),
            sqlite_where=sa.text("status = 'open'"),
        )

    op.create_table(
        "classification",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("email_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("model_id", sa.String(length=255), nullable=False),
        sa.Column("prompt_version", sa.String(length=64), nullable=False),
        sa.Column("output", sa.JSON(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["email_id"],
            ["email_message.id"],
            name=op.f("fk_classification_email_id_email_message"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["pipeline_run.id"], name=op.f("fk_classification_run_id_pipeline_run")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_classification")),
        sa.UniqueConstraint("run_id", name=op.f("uq_classification_run_id")),
    )


def downgrade() -> None:
    op.drop_table("classification")
    with op.batch_alter_table("pipeline_run", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_pipeline_run_open",
            postgresql_where=sa.text("status = 'open'"),
            sqlite_where=sa.text("status = 'open'"),
        )
        batch_op.drop_index(
            "ix_pipeline_run_failed",
            postgresql_where=sa.text("status = 'failed'"),
            sqlite_where=sa.text("status = 'failed'"),
        )

    op.drop_table("pipeline_run")
    op.drop_table("email_label")
    op.drop_table("document")
    with op.batch_alter_table("email_message", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_email_message_no_run",
            postgresql_where=sa.text("NOT has_run"),
            sqlite_where=sa.text("NOT has_run"),
        )
        batch_op.drop_index(
            "ix_email_message_needs_review",
            postgresql_where=sa.text("needs_review"),
            sqlite_where=sa.text("needs_review"),
        )
        batch_op.drop_index("ix_email_message_duplicate_of")

    with op.batch_alter_table("email_message", schema=None) as batch_op:
        batch_op.drop_constraint(
            op.f("fk_email_message_origin_id_email_origin"), type_="foreignkey"
        )
    op.drop_table("email_origin")
    op.drop_table("email_message")
    op.drop_table("sweep_report")
    op.drop_table("runtime_flag")
    # PostgreSQL keeps enum types after their tables; SQLite has none to drop.
    for name in ("document_status", "run_status"):
        sa.Enum(name=name).drop(op.get_bind(), checkfirst=True)
