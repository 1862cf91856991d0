"""A job's cost metrics, from its stored rows (token counts) and the engine counters of every attempt
at its shards (device time, padding, batch size, KV use), the attempts that failed, were handed back
or died included. Used at finalize and, for a running job, on every metrics request."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from jobs.domain.settings import Settings
from storage.attempt_store import attempt_totals, attempted_shards
from storage.job_store import request_counts, seconds_between
from storage.models import Job, Shard, utcnow
from storage.result_store import cached_sums, token_sums
from storage.shard_store import shards_of
from storage.summary_store import summary_counts

# Engine counters that add up across attempts (each attempt records its own difference).
SUMMED_STATS = (
    "steps", "computed_tokens", "cached_prompt_tokens", "draft_tokens", "accepted_draft_tokens",
    "padding_tokens", "preemptions", "batch_size_sum", "busy_seconds",
    "saved_device_seconds",  # what the rows reused from the result cache cost when they first ran
)


def compute_metrics(
    session: Session, job: Job, settings: Settings, finished_at: datetime | None = None
) -> dict[str, Any]:
    stored_rows, prompt_tokens, output_tokens = token_sums(session, job.id)
    counts = request_counts(session, job.id, job.num_rows)
    shards = shards_of(session, job.id)
    totals, peak_kv = _engine_totals(session, job.id, shards)

    end = finished_at or job.finished_at or utcnow()
    wall = seconds_between(job.started_at, end)
    device_seconds = totals["busy_seconds"]
    total_tokens = prompt_tokens + output_tokens
    cost = device_seconds / 3600.0 * settings.device_hour_usd
    parameters, active = _model_parameters(shards)
    # every token through the model, rejected drafts included (they ran but left no KV)
    run_tokens = totals["computed_tokens"] + totals["draft_tokens"] - totals["accepted_draft_tokens"]
    return {
        "rows": job.num_rows,
        "rows_completed": counts["completed"],
        "rows_failed": counts["failed"],
        "rows_cancelled": job.num_rows - stored_rows if job.cancel_requested else 0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "padding_tokens": int(totals["padding_tokens"]),
        "computed_tokens": int(totals["computed_tokens"]),
        "cached_prompt_tokens": int(totals["cached_prompt_tokens"]),
        "draft_tokens": int(totals["draft_tokens"]),
        "accepted_draft_tokens": int(totals["accepted_draft_tokens"]),
        "device_seconds": round(device_seconds, 4),
        "wall_seconds": round(wall, 4),
        "queue_seconds": round(seconds_between(job.created_at, job.started_at or end), 4),
        "tokens_per_second": round(total_tokens / wall, 2) if wall else 0.0,
        "output_tokens_per_second": round(output_tokens / wall, 2) if wall else 0.0,
        "rows_per_second": round(stored_rows / wall, 3) if wall else 0.0,
        "device_hour_usd": settings.device_hour_usd,
        "cost_usd": round(cost, 8),
        "cost_per_million_tokens_usd": round(cost / total_tokens * 1e6, 6) if total_tokens else 0.0,
        "mean_batch_size": round(totals["batch_size_sum"] / totals["steps"], 2) if totals["steps"] else 0.0,
        "peak_kv_utilization": round(peak_kv, 4),
        "preemptions": int(totals["preemptions"]),
        "model_parameters": parameters,
        "active_parameters": active,
        "model_flops": int(2 * active * run_tokens),
        "shards": len(shards),
        "execution": _execution(shards),
        **_summary_metrics(session, job),
        **_cache_metrics(session, job, totals),
    }


def _engine_totals(session: Session, job_id: str, shards: list[Shard]) -> tuple[dict[str, float], float]:
    """SUMMED_STATS over every attempt of every shard, and the peak KV use over the job. A shard's own
    stats hold only the attempt that finished it; they stand in for attempts only for a shard with no
    attempt rows (finished before they were recorded)."""
    spent = attempt_totals(session, job_id=job_id)
    totals = {name: spent.get(name, 0.0) for name in SUMMED_STATS}
    peak_kv = spent.get("peak_kv_utilization", 0.0)
    attempted = attempted_shards(session, job_id=job_id)
    for shard in shards:
        engine = (shard.stats or {}).get("engine", {})
        if shard.shard_index not in attempted:
            for name in SUMMED_STATS:
                totals[name] += float(engine.get(name, 0))
        peak_kv = max(peak_kv, float(engine.get("peak_kv_utilization", 0.0)))
    return totals, peak_kv


def _model_parameters(shards: list[Shard]) -> tuple[int, int]:
    """The served model's parameters, total and active per token, as the shards' engines counted them (a
    job runs on one model; shards finished before engines recorded them count 0)."""
    engines = [(shard.stats or {}).get("engine", {}) for shard in shards]
    return (max((int(e.get("parameters", 0)) for e in engines), default=0),
            max((int(e.get("active_parameters", 0)) for e in engines), default=0))  # fmt: skip


def _execution(shards: list[Shard]) -> list[dict[str, Any]]:
    """Where the shards ran: each distinct CPU tier and per-op paths, with the shards that used them
    (a job's cost is explainable only with the machine it ran on)."""
    groups: dict[str, dict[str, Any]] = {}
    for shard in shards:
        engine = (shard.stats or {}).get("engine", {})
        if "tier" not in engine:
            continue
        entry = {"tier": engine["tier"], "paths": engine.get("paths", {})}
        key = repr(sorted(entry.items(), key=str))
        groups.setdefault(key, {**entry, "shards": []})["shards"].append(shard.shard_index)
    return list(groups.values())


def _summary_metrics(session: Session, job: Job) -> dict[str, int]:
    """Summarize jobs: how many documents went through windows, and the extra requests that took."""
    if job.params.get("task") != "summarize":
        return {"documents_split": 0, "windows": 0, "reduce_requests": 0}
    counts = summary_counts(session, job.id)
    return {
        "documents_split": counts.documents_split,
        "windows": counts.windows,
        "reduce_requests": counts.reduce_requests,
    }


def _cache_metrics(session: Session, job: Job, totals: dict[str, float]) -> dict[str, Any]:
    """Rows reused from the tenant's result cache instead of run (docs/result-cache.md), and what they
    saved: their tokens, and the engine time they cost when they first ran."""
    rows, prompt_tokens, output_tokens = cached_sums(session, job_id=job.id)
    return {
        "cached_rows": rows,
        "saved_prompt_tokens": prompt_tokens,
        "saved_output_tokens": output_tokens,
        "saved_device_seconds": round(totals["saved_device_seconds"], 4),
    }
