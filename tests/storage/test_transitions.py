"""The job lifecycle table (storage.status.JOB_TRANSITIONS): it is the only place moves are written
down, every move the code makes is in it, and job_store.move refuses the others."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import job_store
from storage.db import make_engine, make_session_factory
from storage.models import utcnow
from storage.shard_store import claim_shard, finish_shard
from storage.status import (
    CANCELLABLE_JOB_STATUSES,
    FINAL_JOB_STATUSES,
    JOB_TRANSITIONS,
    JobStatus,
    ShardStatus,
    allowed_sources,
)

ROOT = Path(__file__).resolve().parents[2]
S = JobStatus


def test_the_table_is_the_documented_lifecycle() -> None:
    assert JOB_TRANSITIONS == {
        S.QUEUED: {S.VALIDATING},
        S.IN_PROGRESS: {S.QUEUED},
        S.CANCELLING: {S.VALIDATING, S.QUEUED, S.IN_PROGRESS},
        S.FINALIZING: {S.QUEUED, S.IN_PROGRESS, S.CANCELLING},
        S.COMPLETED: {S.FINALIZING},
        S.CANCELLED: {S.FINALIZING},
        S.FAILED: {S.QUEUED, S.FINALIZING},
    }
    assert JOB_TRANSITIONS[S.CANCELLING] == CANCELLABLE_JOB_STATUSES
    # A final status is left by no move, and a job only starts in validating.
    assert not FINAL_JOB_STATUSES & set().union(*JOB_TRANSITIONS.values())
    assert allowed_sources(S.VALIDATING) == frozenset()


def _move_calls() -> Iterator[tuple[str, ast.Call]]:
    for package in ("jobs", "worker", "storage"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and _is_job_move(node.func):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", node


def _is_job_move(func: ast.expr) -> bool:
    """`move(...)` inside job_store, `job_store.move(...)` elsewhere; not another object's move (a file's)."""
    if isinstance(func, ast.Name):
        return func.id in ("move", "_move")
    return isinstance(func, ast.Attribute) and func.attr == "move" and getattr(func.value, "id", None) == "job_store"


def _status(node: ast.expr) -> JobStatus | None:
    if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "JobStatus":
        return JobStatus[node.attr]
    return None


def test_every_move_in_the_code_is_in_the_table() -> None:
    calls = list(_move_calls())
    assert len(calls) >= 5, calls  # the checker sees the moves (start, cancel, finalizing, end, failed)
    targets = set()
    for where, call in calls:
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        assert "to" in keywords, f"{where}: a move names its target status as to=..."
        to = _status(keywords["to"])
        if to is None:
            continue  # a variable (finalize's completed-or-cancelled), checked by move itself at run time
        targets.add(to)
        assert to in JOB_TRANSITIONS, f"{where}: a move to {to} is not in JOB_TRANSITIONS"
        only_from = keywords.get("only_from")
        if only_from is not None:
            assert isinstance(only_from, ast.List | ast.Tuple), where
            sources = {_status(element) for element in only_from.elts}
            assert sources <= JOB_TRANSITIONS[to], f"{where}: {sources} -> {to} is not in JOB_TRANSITIONS"
    # `queued` is entered when a submission stores its job (job_store.create_queued_job), not by a move.
    assert {S.IN_PROGRESS, S.CANCELLING, S.FINALIZING, S.FAILED} <= targets
    # No list of allowed sources written anywhere else.
    for package in ("jobs", "worker", "storage"):
        for path in (ROOT / package).rglob("*.py"):
            assert "from_statuses" not in path.read_text(encoding="utf-8"), path


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _queued_job(session: Session) -> str:
    job_id = job_store.new_job_id()
    job_store.create_queued_job(
        session, job_id=job_id, tenant="t", model="m", params={}, metadata={}, input_name=f"jobs/{job_id}/in",
        created_at=utcnow(), num_rows=1, shards=[[0]],
    )  # fmt: skip
    return job_id


def test_moves_outside_the_table_are_refused(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job_id = _queued_job(session)
        with pytest.raises(ValueError, match="illegal job move"):
            job_store.move(session, job_id, to=S.VALIDATING)
        with pytest.raises(ValueError, match="illegal job move"):
            job_store.move(session, job_id, to=S.COMPLETED, only_from=[S.QUEUED])
        # Allowed in the table, but not from where the job is: no move, no event.
        assert not job_store.move(session, job_id, to=S.COMPLETED)
        assert not job_store.move(session, job_id, to=S.QUEUED)
        assert job_store.move(session, job_id, to=S.IN_PROGRESS)
        assert not job_store.move(session, job_id, to=S.FAILED, only_from=[S.FINALIZING])
        assert job_store.job_status(session, job_id) == S.IN_PROGRESS
        assert [event.status for event in job_store.events(session, job_id)] == [
            S.VALIDATING,
            S.QUEUED,
            S.IN_PROGRESS,
        ]


def test_mark_finalizing_waits_for_every_shard(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job_id = _queued_job(session)
        assert not job_store.mark_finalizing(session, job_id)
        claim_shard(session, job_id, 0, "w", lease_seconds=60)
        finish_shard(session, job_id, 0, "w", ShardStatus.DONE, None)
        assert job_store.mark_finalizing(session, job_id)
        assert job_store.mark_finalizing(session, job_id)  # already finalizing: still True, no second move
        assert job_store.move(session, job_id, to=S.COMPLETED)
        assert not job_store.mark_finalizing(session, job_id)
        statuses = [event.status for event in job_store.events(session, job_id)]
        assert statuses == [S.VALIDATING, S.QUEUED, S.FINALIZING, S.COMPLETED]
