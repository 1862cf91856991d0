"""inputs by reference: a shard of such a job is a list of row-group ranges of the referenced Parquet
files (`pieces`), not a list of row indices

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 16:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("shards", sa.Column("pieces", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("shards", "pieces")
