"""model registry: what a worker made of each model it loaded (family, own context, loadable or why not)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-12 09:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_registry",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("model_type", sa.String(length=200), nullable=True),
        sa.Column("context_len", sa.Integer(), nullable=True),
        sa.Column("loadable", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("recorded_by", sa.String(length=200), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("model_registry")
