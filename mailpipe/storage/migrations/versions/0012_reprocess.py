"""reprocess: an operator's re-run of ended emails, and which runs it reopened

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

Only adds: a table, a nullable column and an index built concurrently on PostgreSQL. The column
has no foreign key, which would be a constraint added to a table the previous release writes;
the reprocess rows are never deleted while a run names them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_INDEX = "ix_pipeline_run_reprocess"


def upgrade() -> None:
    op.create_table(
        "reprocess",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("from_step", sa.String(length=16), nullable=False),
        sa.Column("lane", sa.String(length=8), nullable=False),
        sa.Column("search", sa.JSON(), nullable=False),
        sa.Column("emails", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reprocess")),
    )
    op.add_column("pipeline_run", sa.Column("reprocess_id", sa.BigInteger(), nullable=True))
    where = sa.text("reprocess_id IS NOT NULL")
    if op.get_context().dialect.name != "postgresql":
        op.create_index(_INDEX, "pipeline_run", ["reprocess_id", "status"], sqlite_where=where)
        return
    # CONCURRENTLY cannot run inside a transaction.
    with op.get_context().autocommit_block():
        op.create_index(
            _INDEX,
            "pipeline_run",
            ["reprocess_id", "status"],
            postgresql_where=where,
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="pipeline_run", if_exists=True)
    op.drop_column("pipeline_run", "reprocess_id")
    op.drop_table("reprocess")
