"""deadlines and priorities: each job's priority class, deadline (from its completion window), the
warning given at submission when the quote said the deadline could not be met, and when it expired;
an index for the workers' claim of the best pending shard

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("priority", sa.String(length=10), nullable=False, server_default="normal")
    )
    op.add_column("jobs", sa.Column("deadline", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("deadline_warning", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_shards_status", "shards", ["status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_shards_status", table_name="shards")
    op.drop_column("jobs", "expired_at")
    op.drop_column("jobs", "deadline_warning")
    op.drop_column("jobs", "deadline")
    op.drop_column("jobs", "priority")
