"""Files and batches of the OpenAI-compatible API on real Postgres: scoped to a tenant, paged newest
first, outputs recorded once, expiry noted once."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import openai_store
from storage.db import make_engine, make_session_factory
from storage.models import utcnow


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _file(session: Session, tenant: str, purpose: str = "batch") -> str:
    file_id = openai_store.new_file_id()
    openai_store.add_file(
        session,
        file_id=file_id,
        tenant=tenant,
        purpose=purpose,
        filename="in.jsonl",
        size=3,
        blob_name=openai_store.file_blob_name(file_id),
    )
    return file_id


def _batch(session: Session, tenant: str, input_file_id: str) -> str:
    batch_id = openai_store.new_batch_id()
    now = utcnow()
    openai_store.add_batch(
        session,
        batch_id=batch_id,
        tenant=tenant,
        job_id=None,
        endpoint="/v1/completions",
        input_file_id=input_file_id,
        completion_window="24h",
        metadata={},
        created_at=now,
        expires_at=now + timedelta(hours=24),
        line_errors=[],
        errors=None,
    )
    return batch_id


def test_files_are_scoped_to_their_tenant_and_paged_newest_first(sessions: sessionmaker[Session]) -> None:
    tenant = f"t-{openai_store.new_file_id()}"
    with sessions() as session:
        ids = [_file(session, tenant) for _ in range(3)]
        output = _file(session, tenant, "batch_output")
        assert openai_store.get_file(session, ids[0], "someone-else") is None
        page, more = openai_store.list_files(session, tenant, purpose="batch", after=None, limit=2)
        assert [row.id for row in page] == [ids[2], ids[1]] and more
        page, more = openai_store.list_files(session, tenant, purpose="batch", after=ids[1], limit=2)
        assert [row.id for row in page] == [ids[0]] and not more
        assert [
            row.id for row in openai_store.list_files(session, tenant, purpose=None, after=None, limit=1)[0]
        ] == [output]
        with pytest.raises(LookupError):
            openai_store.list_files(session, "someone-else", purpose=None, after=ids[0], limit=2)
        assert not openai_store.delete_file(session, ids[0], "someone-else")
        assert openai_store.delete_file(session, ids[0], tenant)
        assert openai_store.get_file(session, ids[0], tenant) is None


def test_outputs_are_recorded_once_and_expiry_noted_once(sessions: sessionmaker[Session]) -> None:
    tenant = f"t-{openai_store.new_file_id()}"
    with sessions() as session:
        batch_id = _batch(session, tenant, _file(session, tenant))
        assert openai_store.get_batch(session, batch_id, "someone-else") is None
        first = {
            "file_id": openai_store.new_file_id(),
            "tenant": tenant,
            "purpose": "batch_output",
            "filename": "out.jsonl",
            "size": 1,
            "blob_name": "openai/files/x.jsonl",
        }
        assert openai_store.set_outputs(
            session, batch_id, [first], output_file_id=first["file_id"], error_file_id=None
        )
        second = {**first, "file_id": openai_store.new_file_id()}
        assert not openai_store.set_outputs(
            session, batch_id, [second], output_file_id=second["file_id"], error_file_id=None
        )
        assert openai_store.get_file(session, second["file_id"], tenant) is None
        batch = openai_store.get_batch(session, batch_id, tenant)
        assert batch.output_file_id == first["file_id"] and batch.outputs_ready
        assert openai_store.mark_expired(session, batch_id, utcnow())
        assert not openai_store.mark_expired(session, batch_id, utcnow())
