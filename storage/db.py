"""Database engines and sessions, and `upgrade` (Alembic) for Postgres and the embedded SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def migrations_dir() -> Path:
    """The Alembic scripts ship as the `migrations` package, so an installed Freight finds them too."""
    import migrations

    return Path(next(iter(migrations.__path__))).resolve()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        db_path = url.split("sqlite:///", 1)[-1]
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # pre_ping: a connection killed under us (restart, pg_terminate_backend) is replaced, not reused.
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at `url` to `revision` (what `freight db upgrade` runs)."""
    from alembic import command

    if url.startswith("sqlite:///"):
        Path(url.split("sqlite:///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
