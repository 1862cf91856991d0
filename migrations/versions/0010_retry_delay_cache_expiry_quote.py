"""a failed shard's retry time (claims by ticket wait it out), the result cache's expiry sweep (an
index on when each entry was stored), and each job's quote at submission (its report shows it)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 18:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("shards", sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_result_cache_created_at", "result_cache", ["created_at"])
    op.add_column("jobs", sa.Column("quote", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("quote")
    op.drop_index("ix_result_cache_created_at", table_name="result_cache")
    with op.batch_alter_table("shards") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("retry_at")
