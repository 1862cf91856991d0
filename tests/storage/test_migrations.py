"""The Alembic migrations build exactly the schema the models describe, on Postgres and SQLite."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from storage.db import alembic_config, current_revision, make_engine, upgrade
from storage.models import Base

TABLES = {
    "api_keys",
    "jobs",
    "shards",
    "shard_attempts",
    "results",
    "job_events",
    "summary_parts",
    "openai_files",
    "openai_batches",
    "model_registry",
    "throughput_profiles",
    "result_cache",
    "alembic_version",
}


def _head(url: str) -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def _schema_diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()


def test_postgres_schema_matches_models(pg_url: str) -> None:
    assert current_revision(pg_url) == _head(pg_url)
    assert _schema_diff(pg_url) == []
    engine = make_engine(pg_url)
    try:
        assert TABLES <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_sqlite_upgrade_is_repeatable(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nested' / 'freight.db'}"
    upgrade(url)
    upgrade(url)  # a second upgrade is a no-op, as `freight run` does on every start
    assert current_revision(url) == _head(url)
    assert _schema_diff(url) == []


def test_sqlite_shard_attempts_migration_goes_down_and_up(tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'freight.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "0002")
    engine = make_engine(url)
    try:
        assert "shard_attempts" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    upgrade(url)
    assert current_revision(url) == _head(url) and _schema_diff(url) == []


def test_sqlite_openai_batches_migration_goes_down_and_up(tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'freight.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "0003")
    engine = make_engine(url)
    try:
        assert not {"openai_files", "openai_batches"} & set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    upgrade(url)
    assert current_revision(url) == _head(url) and _schema_diff(url) == []


def test_sqlite_model_registry_migration_goes_down_and_up(tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'freight.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "0004")
    engine = make_engine(url)
    try:
        assert "model_registry" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    upgrade(url)
    assert current_revision(url) == _head(url) and _schema_diff(url) == []


def test_sqlite_throughput_profiles_migration_goes_down_and_up(tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'freight.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "0005")
    engine = make_engine(url)
    try:
        assert "throughput_profiles" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    upgrade(url)
    assert current_revision(url) == _head(url) and _schema_diff(url) == []


def test_sqlite_deadlines_migration_goes_down_and_up(tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'freight.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "0006")
    engine = make_engine(url)
    try:
        columns = {column["name"] for column in inspect(engine).get_columns("jobs")}
        assert not columns & {"priority", "deadline", "deadline_warning", "expired_at"}
    finally:
        engine.dispose()
    upgrade(url)
    assert current_revision(url) == _head(url) and _schema_diff(url) == []
