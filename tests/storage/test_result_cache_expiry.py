"""Result cache entries expire (FREIGHT_RESULT_CACHE_TTL_SECONDS) on real Postgres: a lookup never
returns an entry stored before its cutoff and deletes it, so the row runs and stores a fresh one in its
place; the sweep deletes every tenant's expired entries and keeps the fresh ones."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from storage.db import make_engine, make_session_factory
from storage.models import ResultCacheEntry, utcnow
from storage.result_cache_store import CachedOutput, cached_outputs, delete_expired, remember_outputs

TTL = timedelta(days=30)


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _output(key: str, text: str = "out") -> CachedOutput:
    return CachedOutput(key, text, 3, 2, "stop", 0.5)


def _store(sessions, tenant: str, keys: list[str], *, age: timedelta = timedelta(0), text: str = "out") -> None:
    with sessions() as session:
        remember_outputs(session, tenant=tenant, job_id="job", outputs=[_output(key, text) for key in keys])
        session.execute(
            update(ResultCacheEntry)
            .where(ResultCacheEntry.tenant == tenant, ResultCacheEntry.key.in_(keys))
            .values(created_at=utcnow() - age)
        )
        session.commit()


def _keys_of(sessions, tenant: str) -> set[str]:
    with sessions() as session:
        return set(session.scalars(select(ResultCacheEntry.key).where(ResultCacheEntry.tenant == tenant)))


def test_an_expired_entry_is_never_reused_and_is_deleted_at_lookup(sessions) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    _store(sessions, tenant, ["fresh", "edge"], age=TTL - timedelta(minutes=1))
    _store(sessions, tenant, ["old"], age=TTL + timedelta(minutes=1))
    with sessions() as session:
        found = cached_outputs(session, tenant=tenant, keys=["fresh", "old", "edge", "absent"], fresh_since=utcnow() - TTL)
    assert sorted(found) == ["edge", "fresh"]
    assert _keys_of(sessions, tenant) == {"fresh", "edge"}  # the expired one is gone
    # The row that ran again stores its output afresh under the same key (nothing old blocks it).
    _store(sessions, tenant, ["old"], text="new")
    with sessions() as session:
        again = cached_outputs(session, tenant=tenant, keys=["old"], fresh_since=utcnow() - TTL)
    assert again["old"].output_text == "new"


def test_the_sweep_deletes_every_tenants_expired_entries_only(sessions) -> None:
    tenants = [f"t-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for tenant in tenants:
        _store(sessions, tenant, ["a", "b"], age=TTL + timedelta(days=1))
        _store(sessions, tenant, ["c"], age=timedelta(hours=1))
    with sessions() as session:
        before = session.scalar(select(func.count()).select_from(ResultCacheEntry))
        deleted = delete_expired(session, before=utcnow() - TTL)
        after = session.scalar(select(func.count()).select_from(ResultCacheEntry))
    assert deleted >= 4 and before - after == deleted  # other tests' expired entries may go too
    for tenant in tenants:
        assert _keys_of(sessions, tenant) == {"c"}
