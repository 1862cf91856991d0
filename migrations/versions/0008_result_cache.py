"""result cache: each tenant's finished outputs by key digest (model revision, numerics, prompt tokens,
sampling), and whether a result row was reused from it

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "result_cache",
        sa.Column("tenant", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("output_text", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=20), nullable=False),
        sa.Column("device_seconds", sa.Float(), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "key"),
    )
    op.add_column("results", sa.Column("cached", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("results") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("cached")
    op.drop_table("result_cache")
