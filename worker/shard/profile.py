"""Each finished shard adds what it measured to its model's throughput profile (storage/profile_store.py),
the rates a quote prices jobs with (jobs/domain/quote.py): measured on every shard, never configured."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from jobs.domain.settings import Settings
from storage import job_store
from storage.profile_store import ShardWork, record_shard

log = logging.getLogger(__name__)
UNKNOWN_CLASS = "unknown"  # an engine that reported no tier (none does today)


def shard_work(stats: dict[str, Any], params: dict[str, Any]) -> ShardWork | None:
    """The work of the attempt that finished the shard (its stats, engine_stats.shard_stats), or None
    when it ran nothing on the engine (every row was stored by an earlier attempt)."""
    engine = stats.get("engine") or {}
    rows = int(stats.get("rows_run", 0))
    busy = float(engine.get("busy_seconds", 0.0))
    if rows <= 0 or busy <= 0:
        return None
    # Only plain generation caps each row at max_tokens; a summarize row makes several requests.
    capped = params.get("task", "generate") == "generate"
    return ShardWork(
        rows=rows,
        prompt_tokens=int(engine.get("prompt_tokens", 0)),
        output_tokens=int(engine.get("output_tokens", 0)),
        busy_seconds=busy,
        max_tokens=rows * int(params.get("max_tokens", 0)) if capped else 0,
    )


def worker_class(settings: Settings, stats: dict[str, Any]) -> str:
    return settings.worker_class or str((stats.get("engine") or {}).get("tier") or UNKNOWN_CLASS)


def record_finished_shard(session: Session, settings: Settings, job_id: str, stats: dict[str, Any]) -> None:
    """Add the finished shard to its profile; commits. The shard is done whatever happens here: a
    failure costs the profile one sample, not the shard a retry."""
    try:
        job = job_store.get_job(session, job_id)
        work = None if job is None else shard_work(stats, job.params)
        if work is not None:
            record_shard(session, model=job.model, worker_class=worker_class(settings, stats), work=work)
    except Exception:
        log.exception("could not add shard stats of %s to the throughput profile", job_id)
        session.rollback()
