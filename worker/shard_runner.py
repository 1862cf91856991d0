"""Run one shard: claim it, skip rows already stored, build and tokenize prompts, run the engine
(shortest first), write rows as they finish, record the shard's engine stats, and say whether the
job is ready to finalize. Each run is an attempt (a shard_attempts row) that keeps the engine counters
it spent however it ends, so the job's cost counts failed and interrupted runs too. The Celery task
and the embedded `freight run` both call `run_shard`."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.parquet as pq
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.prompts import PromptSource, resolve_source
from jobs.domain.schemas import OVERRIDE_COLUMNS, ResolvedParams
from jobs.domain.settings import Settings
from storage import job_store
from storage.blobs import BlobStore
from storage.result_store import insert_results, stored_row_indices
from storage.shard_store import Claim, claim_shard, finish_shard, get_shard, release_shard
from storage.status import AttemptOutcome, FinishReason, JobStatus, ShardStatus
from worker.attempt_meter import AttemptMeter
from worker.engine import LLM, SamplingParams
from worker.engine_stats import shard_stats
from worker.inputs import read_rows
from worker.llm_pool import LLMPool
from worker.result_writer import ProgressCallback, ResultWriter
from worker.retry import ShardRetry
from worker.summarize_runner import PartWriter, summarize_rows
from worker.truncation import truncated_ids

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 500


@dataclass
class WorkerContext:
    settings: Settings
    sessions: sessionmaker[Session]
    blobs: BlobStore
    # Set when the worker is shutting down (SIGTERM): running shards stop between engine steps,
    # keep the rows they finished and hand the rest back.
    stopping: threading.Event = field(default_factory=threading.Event)

    def owner(self) -> str:
        """Who holds a lease: host, process and thread (a threads pool runs shards side by side)."""
        return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


@dataclass
class ShardOutcome:
    job_id: str
    shard_index: int
    claim: str
    status: str | None = None  # the shard's status after this run, when this run finished it
    rows_written: int = 0
    ready_to_finalize: bool = False
    handed_back: bool = False  # the worker is shutting down; the shard's unfinished rows run elsewhere

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ShardHandedBack(Exception):
    """The worker is shutting down: the shard was released with its finished rows kept."""

    def __init__(self, rows_written: int) -> None:
        super().__init__(f"handed back after {rows_written} rows")
        self.rows_written = rows_written


@dataclass
class PreparedRow:
    row_index: int
    custom_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


def run_shard(
    ctx: WorkerContext,
    pool: LLMPool,
    job_id: str,
    shard_index: int,
    on_progress: ProgressCallback | None = None,
) -> ShardOutcome:
    owner = ctx.owner()
    with ctx.sessions() as session:
        claim = claim_shard(session, job_id, shard_index, owner, ctx.settings.shard_lease_seconds)
    outcome = ShardOutcome(job_id, shard_index, claim.value)
    if claim == Claim.FINISHED:
        outcome.ready_to_finalize = ready_to_finalize(ctx, job_id)
    if claim != Claim.CLAIMED:
        return outcome
    meter = AttemptMeter()
    try:
        with ctx.sessions() as session:
            meter.start(session, job_id=job_id, shard_index=shard_index, owner=owner)
        with pool.lock:
            try:
                outcome.status, outcome.rows_written = _execute(
                    ctx, pool, meter, job_id, shard_index, owner, on_progress
                )
            finally:
                # Past the lock the engine's counters move for another shard: a failure recorded
                # below must not count that shard's work.
                meter.freeze()
    except ShardHandedBack as handed_back:
        outcome.handed_back, outcome.rows_written = True, handed_back.rows_written
        return outcome
    except Exception as exc:
        outcome.status = _after_failure(ctx, meter, job_id, shard_index, owner, exc)
    if outcome.status is not None:
        outcome.ready_to_finalize = ready_to_finalize(ctx, job_id)
    return outcome


def ready_to_finalize(ctx: WorkerContext, job_id: str) -> bool:
    """True when every shard is finished and the job is (now) finalizing (job_store.mark_finalizing)."""
    with ctx.sessions() as session:
        return job_store.mark_finalizing(session, job_id)


def _execute(
    ctx: WorkerContext,
    pool: LLMPool,
    meter: AttemptMeter,
    job_id: str,
    shard_index: int,
    owner: str,
    on_progress: ProgressCallback | None,
) -> tuple[str | None, int]:
    with ctx.sessions() as session:
        job = job_store.get_job(session, job_id)
        shard = get_shard(session, job_id, shard_index)
        if job.cancel_requested:
            _finish(session, meter, job_id, shard_index, owner, ShardStatus.CANCELLED, None)
            return ShardStatus.CANCELLED, 0
        job_store.move(session, job_id, to=JobStatus.IN_PROGRESS)
        stored = stored_row_indices(session, job_id, shard.row_indices)
    params = ResolvedParams(**job.params)
    todo = [index for index in shard.row_indices if index not in stored]
    writer = ResultWriter(
        ctx.settings,
        ctx.sessions,
        job_id=job_id,
        shard_index=shard_index,
        owner=owner,
        rows_total=len(shard.row_indices),
        rows_done=len(stored),
        on_progress=on_progress,
        attempt=meter,
    )
    input_path = ctx.blobs.path(job.input_name)
    schema = pq.read_schema(input_path)
    source = resolve_source(schema, params.template, params.prompt_column, params.chat)
    extra = [name for name in (*OVERRIDE_COLUMNS, "custom_id") if name in schema.names]
    records = read_rows(input_path, todo, list(dict.fromkeys([*source.columns, *extra])))
    llm = pool.get(params)
    before = meter.watch(llm)
    writer.engine_tokens = lambda: int(llm.stats.computed_tokens - before.counters["computed_tokens"])

    def should_stop() -> bool:
        return ctx.stopping.is_set() or writer.should_stop()

    poll_seconds = min(0.5, ctx.settings.cancel_poll_seconds)
    if params.summarize is not None:
        parts = PartWriter(ctx.sessions, job_id, shard_index, ctx.settings.result_chunk_rows, meter)
        rows_run = summarize_rows(llm, params, records, writer, parts, should_stop, poll_seconds)
    else:
        rows_run = _generate(llm, source, params, records, writer, should_stop, poll_seconds)
    writer.flush()
    if ctx.stopping.is_set() and not (writer.cancelled or writer.lease_lost) and rows_run > 0:
        _hand_back(ctx, meter, job_id, shard_index, owner, writer.rows_done - len(stored))
    if writer.lease_lost:
        log.warning("lost the lease on %s shard %d; another worker has it", job_id, shard_index)
        with ctx.sessions() as session:
            meter.record(session, AttemptOutcome.LEASE_LOST)
        return None, writer.rows_done - len(stored)
    status = ShardStatus.CANCELLED if writer.cancelled else ShardStatus.DONE
    stats = shard_stats(before, llm.stats, ctx.settings.timeline_max_points)
    stats.update(rows=len(shard.row_indices), rows_run=rows_run)
    with ctx.sessions() as session:
        _finish(session, meter, job_id, shard_index, owner, status, stats)
    return status, writer.rows_done - len(stored)


def _finish(
    session: Session,
    meter: AttemptMeter,
    job_id: str,
    shard_index: int,
    owner: str,
    status: ShardStatus,
    stats: dict[str, Any] | None,
    error: str | None = None,
) -> None:
    """Finish the shard and end the attempt in one transaction, so a finished shard's cost is all
    stored by the time the job is finalized. When another worker took the shard over first, the
    attempt ends as lease_lost instead (that worker's attempt finishes the shard)."""
    meter.record(session, AttemptOutcome(status), commit=False)
    if not finish_shard(session, job_id, shard_index, owner, status, stats, error=error):  # commits
        meter.record(session, AttemptOutcome.LEASE_LOST)


def _generate(
    llm: LLM,
    source: PromptSource,
    params: ResolvedParams,
    records: dict[int, dict[str, Any]],
    writer: ResultWriter,
    should_stop: Callable[[], bool],
    poll_seconds: float,
) -> int:
    """One request per row, all in one engine stream; returns the rows sent to the engine."""
    prepared = _prepare(llm, source, params, records, writer)
    prepared.sort(key=lambda row: len(row.prompt_ids))  # similar lengths run together
    stream = llm.stream(
        [row.prompt_ids for row in prepared],
        [row.sampling for row in prepared],
        should_cancel=should_stop,
        cancel_poll_seconds=poll_seconds,
    )
    # Closed here when a row's insert raises, while this shard still holds the engine: left to the
    # garbage collector, the suspended stream would abort its requests whenever it is collected, in
    # the middle of the next shard's stream, which would end with its rows unwritten.
    with closing(stream):
        for out in stream:
            row = prepared[out.index]
            writer.add(
                {
                    "row_index": row.row_index,
                    "custom_id": row.custom_id,
                    "output_text": out.text,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "output_tokens": len(out.output_token_ids),
                    "finish_reason": out.finish_reason,
                    "error": out.error,
                }
            )
    return len(prepared)


def _hand_back(
    ctx: WorkerContext, meter: AttemptMeter, job_id: str, shard_index: int, owner: str, rows_written: int
) -> None:
    """Release the shard unless every row finished anyway; the caller requeues its task."""
    with ctx.sessions() as session:
        remaining = set(get_shard(session, job_id, shard_index).row_indices)
        if len(stored_row_indices(session, job_id, sorted(remaining))) == len(remaining):
            return  # the shard finished before the stop took effect: finish it normally
        released = release_shard(
            session, job_id, shard_index, owner, "handed back: worker shutting down", count_attempt=False
        )
        meter.record(session, AttemptOutcome.HANDED_BACK if released else AttemptOutcome.LEASE_LOST)
    log.warning(
        "worker shutting down: handed back %s shard %d after %d rows", job_id, shard_index, rows_written
    )
    raise ShardHandedBack(rows_written)


def _prepare(
    llm: LLM,
    source: PromptSource,
    params: ResolvedParams,
    records: dict[int, dict[str, Any]],
    writer: ResultWriter,
) -> list[PreparedRow]:
    """Prompts for the engine; rows without a usable prompt become error rows right away."""
    texts: list[tuple[int, str, bool]] = []  # (row_index, text, add_special_tokens)
    prompts: dict[int, str | list] = {}  # kept for the truncate option
    for index, record in records.items():
        prompt, problem = source.build(record)
        if prompt is None:
            writer.add(_error_row(index, record, problem))
            continue
        prompts[index] = prompt
        if isinstance(prompt, list):
            # The chat template already holds the special tokens; adding BOS again would double it.
            texts.append((index, llm.apply_chat_template(prompt), False))
        else:
            texts.append((index, prompt, True))
    prepared: list[PreparedRow] = []
    for add_special in (False, True):
        group = [(index, text) for index, text, special in texts if special == add_special]
        if not group:
            continue
        encoded = llm.tokenizer([text for _, text in group], add_special_tokens=add_special)["input_ids"]
        for (index, _text), ids in zip(group, encoded, strict=True):
            record = records[index]
            if len(ids) >= llm.max_model_len and params.truncate:
                budget = llm.max_model_len - int(record.get("max_tokens") or params.max_tokens)
                ids = truncated_ids(llm, prompts[index], ids, max(1, budget)) or ids
            if len(ids) >= llm.max_model_len:
                problem = (
                    f"prompt has {len(ids)} tokens; the model's context is {llm.max_model_len} tokens "
                    "and at least one must be left for output"
                )
                writer.add(_error_row(index, record, problem))
                continue
            prepared.append(
                PreparedRow(
                    index,
                    _custom_id(index, record),
                    ids,
                    _sampling(params, record, index, len(ids), llm.max_model_len),
                )
            )
    return prepared


def _sampling(
    params: ResolvedParams, record: dict[str, Any], index: int, prompt_len: int, max_model_len: int
) -> SamplingParams:
    max_tokens = record.get("max_tokens") or params.max_tokens
    seed = record.get("seed")
    if seed is None and params.seed is not None:
        seed = params.seed + index  # reproducible, yet each row draws its own numbers
    temperature = record.get("temperature")
    top_p = record.get("top_p")
    return SamplingParams(
        max_tokens=max(1, min(int(max_tokens), max_model_len - prompt_len)),
        temperature=params.temperature if temperature is None else float(temperature),
        top_p=params.top_p if top_p is None else float(top_p),
        top_k=params.top_k,
        seed=seed,
        stop=list(params.stop),
    )


def _custom_id(index: int, record: dict[str, Any]) -> str:
    value = record.get("custom_id")
    return str(index) if value is None else value


def _error_row(index: int, record: dict[str, Any], problem: str) -> dict[str, Any]:
    return {
        "row_index": index,
        "custom_id": _custom_id(index, record),
        "output_text": "",
        "prompt_tokens": 0,
        "output_tokens": 0,
        "finish_reason": FinishReason.ERROR.value,
        "error": problem,
    }


def _after_failure(
    ctx: WorkerContext, meter: AttemptMeter, job_id: str, shard_index: int, owner: str, exc: Exception
) -> str:
    """Hand the shard back for another try, or after shard_max_attempts make its remaining rows error
    rows so the job can still finish. Returns the shard's final status, or raises ShardRetry."""
    message = f"{exc.__class__.__name__}: {exc}"[:MAX_ERROR_CHARS]  # a database error quotes its SQL
    log.exception("shard %d of %s failed", shard_index, job_id)
    # A dropped database connection (restart, pg_terminate_backend) is not the shard's fault: the
    # retry resumes from the stored rows without using up one of the shard's attempts.
    disconnected = isinstance(exc, DBAPIError) and exc.connection_invalidated
    with ctx.sessions() as session:
        shard = get_shard(session, job_id, shard_index)
        if disconnected or shard.attempts < ctx.settings.shard_max_attempts:
            released = release_shard(
                session, job_id, shard_index, owner, message, count_attempt=not disconnected
            )
            # What the failed attempt ran is part of the job's cost (the retry reruns its unstored rows).
            meter.record(session, AttemptOutcome.RETRY if released else AttemptOutcome.LEASE_LOST)
            raise ShardRetry(message) from exc
        stored = stored_row_indices(session, job_id, shard.row_indices)
        missing = [index for index in shard.row_indices if index not in stored]
        custom_ids = _custom_ids_or_indices(ctx, job_id, missing)
        problem = f"the shard failed {shard.attempts} times: {message}"
        insert_results(
            session,
            [
                {
                    "job_id": job_id,
                    "shard_index": shard_index,
                    **_error_row(index, {"custom_id": custom_ids[index]}, problem),
                }
                for index in missing
            ],
        )
        _finish(session, meter, job_id, shard_index, owner, ShardStatus.FAILED, None, error=message)
    return ShardStatus.FAILED


def _custom_ids_or_indices(ctx: WorkerContext, job_id: str, rows: list[int]) -> dict[int, str]:
    try:
        with ctx.sessions() as session:
            path = ctx.blobs.path(job_store.get_job(session, job_id).input_name)
        if "custom_id" in pq.read_schema(path).names:
            return {
                index: record["custom_id"] for index, record in read_rows(path, rows, ["custom_id"]).items()
            }
    except Exception:  # the input itself may be what failed; fall back to the row index
        log.exception("could not read custom_ids of %s", job_id)
    return {index: str(index) for index in rows}
