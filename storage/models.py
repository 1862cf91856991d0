"""SQLAlchemy 2.0 tables: API keys, jobs, shards (with lease), shard attempts, result rows, status events,
the files and batches of the OpenAI-compatible API, the model registry, the throughput profiles and the
result cache."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only autoincrements an INTEGER PRIMARY KEY; Postgres gets a BIGINT.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[int]: JSON, datetime: DateTime(timezone=True)}


class ApiKey(Base):
    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public part of the key
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(128))  # sha256(salt + secret), hex
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class Job(Base):
    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)  # cursor order
    id: Mapped[str] = mapped_column(String(40), unique=True)
    tenant: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20))
    model: Mapped[str] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column()
    job_metadata: Mapped[dict[str, Any]] = mapped_column("metadata")
    input_name: Mapped[str] = mapped_column(String(200))  # server-chosen, relative to the blob store
    num_rows: Mapped[int] = mapped_column(Integer, default=0)
    num_shards: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Scheduling (docs/scheduling.md): shards are claimed by priority class, fair share, then deadline.
    priority: Mapped[str] = mapped_column(String(10), default="normal", server_default="normal")
    deadline: Mapped[datetime | None] = mapped_column(default=None)
    deadline_warning: Mapped[str | None] = mapped_column(Text, default=None)  # the quote's ETA missed it
    expired_at: Mapped[datetime | None] = mapped_column(default=None)  # the deadline passed: cancelled
    # Its quote at submission (jobs/domain/quote.py JobQuote): the report sets it beside what the job cost.
    quote: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)

    __table_args__ = (Index("ix_jobs_tenant_seq", "tenant", "seq"),)


class Shard(Base):
    __tablename__ = "shards"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    shard_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    # pending -> running -> done | cancelled | failed; "running" is held by owner until lease_until
    status: Mapped[str] = mapped_column(String(20), default="pending", index=True)  # claim scans pending
    row_indices: Mapped[list[int]] = mapped_column()  # input rows, shortest first
    # An input by reference: the shard's row-group ranges instead ([] row_indices; jobs/domain/sharding.py).
    pieces: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    owner: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    # A failed attempt's retry delay: no ticket claims the shard before then (shard_store.claim_next_shard).
    retry_at: Mapped[datetime | None] = mapped_column(default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # engine stats + timeline
    error: Mapped[str | None] = mapped_column(Text, default=None)


class ShardAttempt(Base):
    """One run of a shard by one worker, from its claim to however it ended, with the engine counters
    it spent. A shard's own stats are written only by the attempt that finishes it; these rows keep
    the cost of the attempts that failed, were handed back or died, so the job's metrics count them."""

    __tablename__ = "shard_attempts"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    shard_index: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    # running until the attempt ends: done | cancelled | failed | retry | handed_back | lease_lost
    outcome: Mapped[str] = mapped_column(String(20))
    # Engine counters spent so far (worker/engine_stats.py COUNTERS, plus peak_kv_utilization).
    counters: Mapped[dict[str, Any]] = mapped_column(default=dict)

    __table_args__ = (Index("ix_shard_attempts_job_id_shard_index", "job_id", "shard_index"),)


class ResultRow(Base):
    __tablename__ = "results"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    row_index: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    custom_id: Mapped[str] = mapped_column(Text)
    output_text: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(20))
    error: Mapped[str | None] = mapped_column(Text, default=None)
    # the output was reused from the tenant's result cache, not run (storage/result_cache_store.py)
    cached: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    shard_index: Mapped[int] = mapped_column(Integer)
    finished_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobEvent(Base):
    """Each status a job entered, in order (for tests, the CLI and the job report)."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(20))
    at: Mapped[datetime] = mapped_column(default=utcnow)


def as_utc(moment: datetime | None) -> datetime | None:
    """SQLite hands datetimes back naive; every stored datetime is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


class SummaryPart(Base):
    """A partial summary of a long document (summarize task, map_reduce): level 0 holds one summary per
    token window, level n + 1 summaries of groups of level-n summaries. Stored as each finishes, so a
    redelivered shard runs only the parts it lacks."""

    __tablename__ = "summary_parts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    row_index: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    part_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    shard_index: Mapped[int] = mapped_column(Integer)
    finished_at: Mapped[datetime] = mapped_column(default=utcnow)


class OpenAIFile(Base):
    """A file of the OpenAI-compatible API: an uploaded batch input, or a batch's output or error file.
    The bytes are in the blob store under `blob_name` (server-chosen)."""

    __tablename__ = "openai_files"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)  # cursor order
    id: Mapped[str] = mapped_column(String(40), unique=True)
    tenant: Mapped[str] = mapped_column(String(200))
    purpose: Mapped[str] = mapped_column(String(20))
    filename: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    blob_name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_openai_files_tenant_seq", "tenant", "seq"),)


class OpenAIBatch(Base):
    """An OpenAI-compatible batch: what its job does not hold. Its status and timestamps come from the
    job (status and events); `job_id` is null only for a batch that failed before it had one."""

    __tablename__ = "openai_batches"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)  # cursor order
    id: Mapped[str] = mapped_column(String(40), unique=True)
    tenant: Mapped[str] = mapped_column(String(200))
    job_id: Mapped[str | None] = mapped_column(String(40), default=None)
    endpoint: Mapped[str] = mapped_column(String(40))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(10))
    batch_metadata: Mapped[dict[str, Any]] = mapped_column("metadata")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column()
    expired_at: Mapped[datetime | None] = mapped_column(default=None)  # the window passed: cancelled
    # Lines refused one by one ({line, custom_id, message, param, code}): they are not rows of the job.
    line_errors: Mapped[list[Any]] = mapped_column(JSON, default=list)
    errors: Mapped[list[Any] | None] = mapped_column(JSON, default=None)  # why the batch failed
    output_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    error_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    outputs_ready: Mapped[bool] = mapped_column(Boolean, default=False)

    __table_args__ = (Index("ix_openai_batches_tenant_seq", "tenant", "seq"),)


class RegisteredModel(Base):
    """What a worker made of a model when it loaded it, one row per model name (the latest word): its
    family, its own context and whether the engine can load it (with the loader's refusal when not). The
    API reads it at submission (jobs/domain/served_models.py); a model with no row is not known yet."""

    __tablename__ = "model_registry"

    name: Mapped[str] = mapped_column(Text, primary_key=True)  # as jobs and queues name it: alias or path
    model_type: Mapped[str | None] = mapped_column(String(200), default=None)  # its config.json's
    # the model's own context (max_position_embeddings), before FREIGHT_MAX_MODEL_LEN caps it; null when
    # the engine cannot load the model
    context_len: Mapped[int | None] = mapped_column(Integer, default=None)
    loadable: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text, default=None)  # the loader's refusal
    recorded_by: Mapped[str] = mapped_column(String(200))  # host:pid of the worker
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)


class ThroughputProfile(Base):
    """What the shards of one model have cost on one class of worker, summed over every shard that
    finished (storage/profile_store.py): the measured throughput a quote prices a job with
    (jobs/domain/quote.py). Sums rather than rates, so each finished shard adds to them in one
    statement and the rates can be fitted again from the sums alone."""

    __tablename__ = "throughput_profiles"

    model: Mapped[str] = mapped_column(Text, primary_key=True)
    # The engine's tier (avx512, amx, cuda, ...) unless FREIGHT_WORKER_CLASS names the worker's class.
    worker_class: Mapped[str] = mapped_column(String(200), primary_key=True)
    shards: Mapped[int] = mapped_column(BigInteger, default=0)
    rows: Mapped[int] = mapped_column(BigInteger, default=0)  # rows the engine ran
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    busy_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    # Least-squares sums over shards (p: prompt tokens, o: output tokens, s: busy seconds), for
    # s = a p + b o: the seconds per prompt token and per output token, fitted from these alone.
    sum_pp: Mapped[float] = mapped_column(Float, default=0.0)
    sum_po: Mapped[float] = mapped_column(Float, default=0.0)
    sum_oo: Mapped[float] = mapped_column(Float, default=0.0)
    sum_ps: Mapped[float] = mapped_column(Float, default=0.0)
    sum_os: Mapped[float] = mapped_column(Float, default=0.0)
    # Generate shards only: their output tokens and rows x max_tokens (how much of the cap rows use).
    capped_output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    capped_max_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class ResultCacheEntry(Base):
    """A finished row's output, kept for reuse by later rows of the same tenant with the same key: the
    digest of the model revision, engine numerics, prompt token ids and sampling parameters
    (worker/shard/cache_key.py). Written after a shard finishes; never shared between tenants."""

    __tablename__ = "result_cache"

    tenant: Mapped[str] = mapped_column(String(200), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex digest
    output_text: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(20))
    device_seconds: Mapped[float] = mapped_column(Float)  # the row's share of its shard's engine time
    job_id: Mapped[str] = mapped_column(String(40))  # the job that ran it (kept if that job is deleted)
    # Entries expire FREIGHT_RESULT_CACHE_TTL_SECONDS after this (the index serves the recovery sweep).
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
