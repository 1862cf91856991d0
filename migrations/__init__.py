"""Alembic migrations, shipped inside the package so `freight db upgrade` works from an install."""
