"""The result cache: each tenant's finished outputs by key digest (worker/shard/cache_key.py). Looked up
before a shard runs, written after it finishes; a row of one tenant never finds another tenant's. An
entry stored before `fresh_since` (FREIGHT_RESULT_CACHE_TTL_SECONDS ago) has expired: a lookup neither
returns nor keeps it (so the row runs and stores a fresh one), and the recovery sweep deletes the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.db import chunked, insert_ignoring_duplicates
from storage.models import ResultCacheEntry


@dataclass(frozen=True)
class CachedOutput:
    """What a later row with the same key reuses (and what it saved: the engine time it cost)."""

    key: str
    output_text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    device_seconds: float


def cached_outputs(
    session: Session, *, tenant: str, keys: Sequence[str], fresh_since: datetime
) -> dict[str, CachedOutput]:
    """{key: output} for the keys the tenant has a finished row for, stored at or after `fresh_since`.
    Expired entries of these keys are deleted first (commits), so the rows that run store fresh ones."""
    for chunk in chunked(sorted(set(keys))):
        session.execute(
            delete(ResultCacheEntry).where(
                ResultCacheEntry.tenant == tenant,
                ResultCacheEntry.key.in_(chunk),
                ResultCacheEntry.created_at < fresh_since,
            )
        )
    session.commit()
    found: dict[str, CachedOutput] = {}
    columns = (
        ResultCacheEntry.key,
        ResultCacheEntry.output_text,
        ResultCacheEntry.prompt_tokens,
        ResultCacheEntry.output_tokens,
        ResultCacheEntry.finish_reason,
        ResultCacheEntry.device_seconds,
    )
    for chunk in chunked(sorted(set(keys))):
        query = select(*columns).where(
            ResultCacheEntry.tenant == tenant,
            ResultCacheEntry.key.in_(chunk),
            ResultCacheEntry.created_at >= fresh_since,
        )
        found.update((row.key, CachedOutput(*row)) for row in session.execute(query))
    return found


def remember_outputs(session: Session, *, tenant: str, job_id: str, outputs: Sequence[CachedOutput]) -> int:
    """Store finished rows' outputs under their keys; a key already stored keeps its first output (equal
    keys give equal outputs where it matters: the batch-invariant mode). Commits; returns rows sent."""
    rows = [
        {
            "tenant": tenant,
            "key": output.key,
            # Postgres text cannot hold NUL; the results table stores U+FFFD for it too (result_store)
            "output_text": output.output_text.replace("\x00", "\ufffd"),
            "prompt_tokens": output.prompt_tokens,
            "output_tokens": output.output_tokens,
            "finish_reason": output.finish_reason,
            "device_seconds": output.device_seconds,
            "job_id": job_id,
        }
        for output in {output.key: output for output in outputs}.values()  # one row per key per statement
    ]
    total = 0
    for chunk in chunked(rows):
        total += insert_ignoring_duplicates(session, ResultCacheEntry, chunk, unique=("tenant", "key"), commit=False)
    session.commit()
    return total


def delete_expired(session: Session, *, before: datetime) -> int:
    """Delete every tenant's entries stored before `before` (the recovery sweep); commits. Returns how many."""
    deleted = session.execute(delete(ResultCacheEntry).where(ResultCacheEntry.created_at < before)).rowcount
    session.commit()
    return deleted
