"""throughput profiles: what each model's finished shards cost per worker class (the quote's rates)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 13:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "throughput_profiles",
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("worker_class", sa.String(length=200), nullable=False),
        sa.Column("shards", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("busy_seconds", sa.Float(), nullable=False),
        sa.Column("sum_pp", sa.Float(), nullable=False),
        sa.Column("sum_po", sa.Float(), nullable=False),
        sa.Column("sum_oo", sa.Float(), nullable=False),
        sa.Column("sum_ps", sa.Float(), nullable=False),
        sa.Column("sum_os", sa.Float(), nullable=False),
        sa.Column("capped_output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("capped_max_tokens", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model", "worker_class"),
    )


def downgrade() -> None:
    op.drop_table("throughput_profiles")
