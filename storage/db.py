"""Database engines and sessions, and `upgrade` (Alembic) for Postgres and the embedded SQLite."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
IN_CHUNK = 1000  # values per `IN (...)`: SQLite and Postgres both take this many bound parameters


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


def insert_ignoring_duplicates(
    session: Session,
    model: type,
    rows: Sequence[dict[str, Any]],
    *,
    unique: Sequence[str],
    commit: bool = True,
) -> int:
    """INSERT the rows, skipping any whose `unique` columns match a row already stored (the first copy
    stays), on Postgres and SQLite alike; commits unless commit=False. Returns the rows sent."""
    if not rows:
        return 0
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    session.execute(insert(model).on_conflict_do_nothing(index_elements=list(unique)), list(rows))
    if commit:
        session.commit()
    return len(rows)


def chunked(values: Sequence[T], size: int = IN_CHUNK) -> Iterator[list[T]]:
    """`values` in lists of at most `size`, for `IN (...)` queries over many values."""
    for start in range(0, len(values), size):
        yield list(values[start : start + size])


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
