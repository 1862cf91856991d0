"""Files and batches of the OpenAI-compatible API, each scoped to a tenant. A batch's status lives in
its job (storage/job_store.py); these rows hold only what the job does not."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.orm import Session

from storage.models import Job, OpenAIBatch, OpenAIFile
from storage.status import FINAL_JOB_STATUSES


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(16)}"


def file_blob_name(file_id: str) -> str:
    return f"openai/files/{file_id}.jsonl"


def add_file(
    session: Session,
    *,
    file_id: str,
    tenant: str,
    purpose: str,
    filename: str,
    size: int,
    blob_name: str,
    commit: bool = True,
) -> OpenAIFile:
    row = OpenAIFile(
        id=file_id, tenant=tenant, purpose=purpose, filename=filename, bytes=size, blob_name=blob_name
    )
    session.add(row)
    if commit:
        session.commit()
    return row


def get_file(session: Session, file_id: str, tenant: str) -> OpenAIFile | None:
    return session.scalars(
        select(OpenAIFile).where(OpenAIFile.id == file_id, OpenAIFile.tenant == tenant)
    ).one_or_none()


def list_files(
    session: Session, tenant: str, *, purpose: str | None, after: str | None, limit: int
) -> tuple[list[OpenAIFile], bool]:
    """Newest first; `after` is the id of the last file of the previous page. (files, has_more)."""
    query = select(OpenAIFile).where(OpenAIFile.tenant == tenant)
    if purpose is not None:
        query = query.where(OpenAIFile.purpose == purpose)
    if after is not None:
        cursor = session.scalar(
            select(OpenAIFile.seq).where(OpenAIFile.id == after, OpenAIFile.tenant == tenant)
        )
        if cursor is None:
            raise LookupError(f"unknown cursor {after!r}")
        query = query.where(OpenAIFile.seq < cursor)
    rows = list(session.scalars(query.order_by(OpenAIFile.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, file_id: str, tenant: str) -> bool:
    result = session.execute(delete(OpenAIFile).where(OpenAIFile.id == file_id, OpenAIFile.tenant == tenant))
    session.commit()
    return result.rowcount == 1


def add_batch(
    session: Session,
    *,
    batch_id: str,
    tenant: str,
    job_id: str | None,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    metadata: dict[str, str],
    created_at: datetime,
    expires_at: datetime,
    line_errors: list[dict[str, Any]],
    errors: list[dict[str, Any]] | None,
    commit: bool = True,
) -> OpenAIBatch:
    """The batch row; with `commit` false it joins the caller's transaction (its job's: both or neither)."""
    row = OpenAIBatch(
        id=batch_id,
        tenant=tenant,
        job_id=job_id,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        batch_metadata=metadata,
        created_at=created_at,
        expires_at=expires_at,
        line_errors=line_errors,
        errors=errors,
    )
    session.add(row)
    if commit:
        session.commit()
    else:
        session.flush()
    return row


def get_batch(session: Session, batch_id: str, tenant: str) -> OpenAIBatch | None:
    return session.scalars(
        select(OpenAIBatch).where(OpenAIBatch.id == batch_id, OpenAIBatch.tenant == tenant)
    ).one_or_none()


def list_batches(
    session: Session, tenant: str, *, after: str | None, limit: int
) -> tuple[list[OpenAIBatch], bool]:
    """Newest first; `after` is the id of the last batch of the previous page. (batches, has_more)."""
    query = select(OpenAIBatch).where(OpenAIBatch.tenant == tenant)
    if after is not None:
        cursor = session.scalar(
            select(OpenAIBatch.seq).where(OpenAIBatch.id == after, OpenAIBatch.tenant == tenant)
        )
        if cursor is None:
            raise LookupError(f"unknown cursor {after!r}")
        query = query.where(OpenAIBatch.seq < cursor)
    rows = list(session.scalars(query.order_by(OpenAIBatch.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def batch_of_job(session: Session, job_id: str) -> OpenAIBatch | None:
    """The batch made with the job, if it was made for one."""
    return session.scalars(select(OpenAIBatch).where(OpenAIBatch.job_id == job_id)).one_or_none()


def batches_awaiting_files(session: Session, *, settled_before: datetime) -> list[OpenAIBatch]:
    """Batches of every tenant whose output and error files are due but not recorded: their job became
    final before `settled_before`, or they have no job and were created before it."""
    final_jobs = select(Job.id).where(
        Job.status.in_(sorted(FINAL_JOB_STATUSES)), Job.finished_at < settled_before
    )
    return list(
        session.scalars(
            select(OpenAIBatch)
            .where(
                OpenAIBatch.outputs_ready.is_(False),
                or_(
                    OpenAIBatch.job_id.in_(final_jobs),
                    and_(OpenAIBatch.job_id.is_(None), OpenAIBatch.created_at < settled_before),
                ),
            )
            .order_by(OpenAIBatch.seq)
        )
    )


def batches_past_window(session: Session, *, now: datetime) -> list[OpenAIBatch]:
    """Batches of every tenant whose window has passed and that are not yet noted as expired."""
    return list(
        session.scalars(
            select(OpenAIBatch).where(
                OpenAIBatch.expired_at.is_(None),
                OpenAIBatch.job_id.is_not(None),
                OpenAIBatch.expires_at <= now,
            )
        )
    )


def mark_expired(session: Session, batch_id: str, at: datetime) -> bool:
    """Note that the batch passed its window (once: True for the one caller that noted it). Commits, with
    whatever the caller's transaction holds (its job's cancel: both or neither)."""
    result = session.execute(
        update(OpenAIBatch)
        .where(OpenAIBatch.id == batch_id, OpenAIBatch.expired_at.is_(None))
        .values(expired_at=at)
    )
    session.commit()
    return result.rowcount == 1


def set_outputs(
    session: Session,
    batch_id: str,
    files: list[dict[str, Any]],
    *,
    output_file_id: str | None,
    error_file_id: str | None,
) -> bool:
    """Record the batch's output and error files (the file rows and the batch's ids) in one
    transaction, unless another caller did first: True when this call recorded them."""
    result = session.execute(
        update(OpenAIBatch)
        .where(OpenAIBatch.id == batch_id, OpenAIBatch.outputs_ready.is_(False))
        .values(outputs_ready=True, output_file_id=output_file_id, error_file_id=error_file_id)
    )
    if result.rowcount != 1:
        session.rollback()
        return False
    for file in files:
        add_file(session, commit=False, **file)
    session.commit()
    return True
