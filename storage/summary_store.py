"""Partial summaries of long documents: inserts that skip parts already stored (a redelivered shard or
a second worker), reads by document, and the counts the job's metrics and results report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from storage.db import chunked, insert_ignoring_duplicates
from storage.models import ResultRow, SummaryPart
from storage.status import COMPLETED_FINISH_REASONS


@dataclass(frozen=True)
class StoredPart:
    text: str
    prompt_tokens: int
    output_tokens: int


PartKey = tuple[int, int]  # (level, part_index)


def insert_parts(session: Session, rows: Sequence[dict[str, Any]], *, commit: bool = True) -> int:
    """Insert parts, keeping the first one stored for each (job, row, level, part); commits unless
    commit=False (the caller adds to the transaction first)."""
    return insert_ignoring_duplicates(
        session, SummaryPart, rows, unique=("job_id", "row_index", "level", "part_index"), commit=commit
    )


def parts_of(
    session: Session, job_id: str, row_indices: Sequence[int]
) -> dict[int, dict[PartKey, StoredPart]]:
    """{row_index: {(level, part_index): part}} for the given documents."""
    found: dict[int, dict[PartKey, StoredPart]] = {}
    for chunk in chunked(row_indices):
        rows = session.execute(
            select(
                SummaryPart.row_index,
                SummaryPart.level,
                SummaryPart.part_index,
                SummaryPart.text,
                SummaryPart.prompt_tokens,
                SummaryPart.output_tokens,
            ).where(SummaryPart.job_id == job_id, SummaryPart.row_index.in_(chunk))
        )
        for row in rows:
            found.setdefault(row.row_index, {})[(row.level, row.part_index)] = StoredPart(
                row.text, row.prompt_tokens, row.output_tokens
            )
    return found


def window_counts(session: Session, job_id: str, start: int, stop: int) -> dict[int, int]:
    """{row_index: number of windows} for documents in [start, stop) that were split."""
    return dict(
        session.execute(
            select(SummaryPart.row_index, func.count())
            .where(
                SummaryPart.job_id == job_id,
                SummaryPart.level == 0,
                SummaryPart.row_index >= start,
                SummaryPart.row_index < stop,
            )
            .group_by(SummaryPart.row_index)
        ).all()
    )


@dataclass(frozen=True)
class SummaryCounts:
    documents_split: int  # documents summarized through windows (so far)
    windows: int  # window requests stored
    reduce_requests: int  # intermediate reduce requests stored + final reduces of finished documents


def summary_counts(session: Session, job_id: str) -> SummaryCounts:
    split, windows, intermediate = session.execute(
        select(
            func.count(distinct(SummaryPart.row_index)),
            func.count().filter(SummaryPart.level == 0),
            func.count().filter(SummaryPart.level > 0),
        ).where(SummaryPart.job_id == job_id)
    ).one()
    split_rows = select(SummaryPart.row_index).where(SummaryPart.job_id == job_id).distinct()
    final_reduces = session.scalar(
        select(func.count())
        .select_from(ResultRow)
        .where(
            ResultRow.job_id == job_id,
            ResultRow.row_index.in_(split_rows),
            ResultRow.finish_reason.in_(COMPLETED_FINISH_REASONS),
        )
    )
    return SummaryCounts(int(split), int(windows), int(intermediate) + int(final_reduces or 0))
