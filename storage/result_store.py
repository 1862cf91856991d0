"""Result rows: bulk inserts that skip rows already stored (unique on job and row), ordered reads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from storage.db import chunked, insert_ignoring_duplicates
from storage.models import ResultRow
from storage.result_record import RESULT_COLUMNS, ResultRecord
from storage.status import COMPLETED_FINISH_REASONS

__all__ = ["RESULT_COLUMNS", "ResultRecord", "insert_results"]


def insert_results(session: Session, rows: Sequence[dict[str, Any]], *, commit: bool = True) -> int:
    """Insert rows (ResultRecord.stored: a record plus job_id and shard_index), skipping any
    (job_id, row_index) already stored; commits unless commit=False (the caller adds to the transaction
    first). Returns rows sent."""
    return insert_ignoring_duplicates(
        session, ResultRow, [_storable(row) for row in rows], unique=("job_id", "row_index"), commit=commit
    )


def _storable(row: dict[str, Any]) -> dict[str, Any]:
    """Postgres text cannot hold NUL: a model that generates the NUL byte gets U+FFFD in its place
    (custom_ids with NUL are refused at submit)."""
    text = row.get("output_text")
    if text is not None and "\x00" in text:
        return {**row, "output_text": text.replace("\x00", "\ufffd")}
    return row


def stored_row_indices(session: Session, job_id: str, row_indices: Sequence[int]) -> set[int]:
    found: set[int] = set()
    for chunk in chunked(row_indices):
        found.update(
            session.scalars(
                select(ResultRow.row_index).where(ResultRow.job_id == job_id, ResultRow.row_index.in_(chunk))
            )
        )
    return found


def iter_results(session: Session, job_id: str, batch_rows: int = 5000) -> Iterator[Sequence[Row]]:
    """Stored rows ordered by row_index, in batches (keyset pagination: memory stays bounded)."""
    columns = [getattr(ResultRow, name) for name in RESULT_COLUMNS]
    last = -1
    while True:
        batch = session.execute(
            select(*columns)
            .where(ResultRow.job_id == job_id, ResultRow.row_index > last)
            .order_by(ResultRow.row_index)
            .limit(batch_rows)
        ).all()
        if not batch:
            return
        yield batch
        last = batch[-1].row_index


def token_sums(session: Session, job_id: str) -> tuple[int, int, int]:
    """(rows stored, prompt tokens, output tokens) over the job's stored rows."""
    count, prompt, output = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(ResultRow.prompt_tokens), 0),
            func.coalesce(func.sum(ResultRow.output_tokens), 0),
        ).where(ResultRow.job_id == job_id)
    ).one()
    return int(count), int(prompt), int(output)


def cached_sums(session: Session, *, job_id: str) -> tuple[int, int, int]:
    """(rows, prompt tokens, output tokens) over the job's rows reused from the result cache."""
    count, prompt, output = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(ResultRow.prompt_tokens), 0),
            func.coalesce(func.sum(ResultRow.output_tokens), 0),
        ).where(ResultRow.job_id == job_id, ResultRow.cached.is_(True))
    ).one()
    return int(count), int(prompt), int(output)


def finish_reason_counts(session: Session, *, job_id: str) -> dict[str, int]:
    """{finish_reason: rows stored with it} for the job."""
    return dict(
        session.execute(
            select(ResultRow.finish_reason, func.count())
            .where(ResultRow.job_id == job_id)
            .group_by(ResultRow.finish_reason)
        ).all()
    )


def results_between(session: Session, *, job_id: str, start: int, stop: int) -> dict[int, ResultRecord]:
    """{row_index: stored record} for the rows in [start, stop)."""
    columns = [getattr(ResultRow, name) for name in RESULT_COLUMNS]
    query = select(*columns).where(
        ResultRow.job_id == job_id, ResultRow.row_index >= start, ResultRow.row_index < stop
    )
    return {row.row_index: ResultRecord(*row) for row in session.execute(query)}


def completed_token_lengths(session: Session, *, job_id: str, batch_rows: int) -> Iterator[Sequence[Row]]:
    """(prompt_tokens, output_tokens) of the job's completed rows in row order, `batch_rows` at a time
    (streamed: memory stays bounded)."""
    rows = session.execute(
        select(ResultRow.prompt_tokens, ResultRow.output_tokens)
        .where(ResultRow.job_id == job_id, ResultRow.finish_reason.in_(COMPLETED_FINISH_REASONS))
        .order_by(ResultRow.row_index)
        .execution_options(yield_per=batch_rows)
    )
    yield from rows.partitions()
