"""openai batches: the files and batches of the OpenAI-compatible Batch API

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 21:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _seq() -> sa.Column:
    return sa.Column(
        "seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "openai_files",
        _seq(),
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant", sa.String(length=200), nullable=False),
        sa.Column("purpose", sa.String(length=20), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("blob_name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("id"),
    )
    op.create_index("ix_openai_files_tenant_seq", "openai_files", ["tenant", "seq"], unique=False)
    op.create_table(
        "openai_batches",
        _seq(),
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant", sa.String(length=200), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=True),
        sa.Column("endpoint", sa.String(length=40), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=10), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("line_errors", sa.JSON(), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("outputs_ready", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("id"),
    )
    op.create_index("ix_openai_batches_tenant_seq", "openai_batches", ["tenant", "seq"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_openai_batches_tenant_seq", table_name="openai_batches")
    op.drop_table("openai_batches")
    op.drop_index("ix_openai_files_tenant_seq", table_name="openai_files")
    op.drop_table("openai_files")
