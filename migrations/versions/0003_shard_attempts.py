"""shard attempts: every run of a shard with the engine counters it spent (the job's cost)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-09 10:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "shard_attempts",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("outcome", sa.String(length=20), nullable=False),
        sa.Column("counters", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_shard_attempts_job_id_shard_index", "shard_attempts", ["job_id", "shard_index"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_shard_attempts_job_id_shard_index", table_name="shard_attempts")
    op.drop_table("shard_attempts")
