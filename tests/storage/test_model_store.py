"""The model registry store on both databases: a worker's record replaces the previous one for the same
name, and the API reads it back by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage.db import make_engine, make_session_factory, upgrade
from storage.model_store import get_model, list_models, record_model


@pytest.fixture(params=["sqlite", "postgres"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'freight.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def test_a_record_replaces_the_previous_one_for_the_same_model(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    name = str(tmp_path / "model")  # unique per test: the Postgres database is the session's
    with sessions() as session:
        assert get_model(session, name=name) is None
        record_model(
            session,
            name=name,
            model_type="falcon",
            context_len=None,
            loadable=False,
            error="unsupported architecture 'falcon'",
            recorded_by="host:1",
        )
        record_model(
            session,
            name=name + "-other",
            model_type="llama",
            context_len=2048,
            loadable=True,
            error=None,
            recorded_by="host:1",
        )
    with sessions() as session:
        refused = get_model(session, name=name)
        assert (refused.model_type, refused.loadable, refused.error) == (
            "falcon",
            False,
            "unsupported architecture 'falcon'",
        )
        first_at = refused.recorded_at
        record_model(
            session,
            name=name,
            model_type="gemma3_text",
            context_len=32768,
            loadable=True,
            error=None,
            recorded_by="host:2",
        )
    with sessions() as session:
        fixed = get_model(session, name=name)
        assert (fixed.model_type, fixed.context_len, fixed.loadable, fixed.error, fixed.recorded_by) == (
            "gemma3_text",
            32768,
            True,
            None,
            "host:2",
        )
        assert fixed.recorded_at >= first_at
        names = [record.name for record in list_models(session)]
    assert [n for n in names if n.startswith(name)] == [name, name + "-other"]
