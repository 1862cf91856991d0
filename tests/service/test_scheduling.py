"""Scheduling on a real `freight api`, one `freight worker` process, Postgres and Redis: a one-hour job
submitted behind a week-long job of the same model finishes first; a tenant's small job submitted after
another tenant's big one finishes long before it (fair share); a job whose quote misses its deadline is
refused when it asked for strict deadlines and accepted with a warning otherwise; bad windows,
deadlines and priorities are 4xx; the CLI takes --window and --priority (docs/scheduling.md)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import delete, select, update

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.cli.main import main as freight_main
from jobs.domain.broker import CeleryDispatcher
from storage import job_store
from storage.db import make_engine, make_session_factory
from storage.models import Job, ShardAttempt, ThroughputProfile
from storage.profile_store import ShardWork, record_shard
from storage.shard_store import shards_of
from tests.service.fixtures import PARKED_MODEL, Process, ServiceEnv, create_api_key
from worker.retry import RetryPolicy

pytestmark = pytest.mark.slow
PROFILE_CLASS = "scheduling-test"


def prompts(rows: int, tag: str) -> pa.Table:
    return pa.table({"prompt": [f"{tag} {i}" for i in range(rows)]})


@pytest.fixture(scope="module")
def sessions(service_env: ServiceEnv):
    engine = make_engine(service_env.settings.resolved_database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="module")
def other_tenant(api_url: str, service_env: ServiceEnv) -> Iterator[FreightClient]:
    with FreightClient(api_url, create_api_key(service_env, "scheduling-b")) as client:
        yield client


def _last_shard_done(sessions, job_id: str) -> datetime:
    with sessions() as session:
        return max(shard.finished_at for shard in shards_of(session, job_id))


def _finished(sessions, job_id: str) -> datetime:
    with sessions() as session:
        return job_store.get_job(session, job_id).finished_at


def _first_shard_started(sessions, job_id: str) -> datetime:
    with sessions() as session:
        return min(shard.started_at for shard in shards_of(session, job_id))


def test_deadline_first_then_fair_share_with_one_worker(
    client: FreightClient, other_tenant: FreightClient, worker: Process, sessions
) -> None:
    # (a) A week-long job of 24 shards, then a one-hour job of 1 shard on the same model and tenant.
    week = client.submit(prompts(96, "week"), max_tokens=1, completion_window="7d")
    hour = client.submit(prompts(4, "hour"), max_tokens=1, completion_window="1h", priority="normal")
    assert (hour["priority"], week["priority"]) == ("normal", "normal")
    assert hour["deadline"] < week["deadline"] and hour["deadline_warning"] is None
    hour_done = client.wait(hour["id"], poll_seconds=0.2, timeout=120)
    assert hour_done["status"] == "completed"
    week_done = client.wait(week["id"], poll_seconds=0.2, timeout=180)
    assert week_done["status"] == "completed" and week_done["request_counts"]["completed"] == 96
    # The hour job did not wait for the week job: most of the week job's shards ran after it was done
    # (finalized too: its finalize does not queue behind the week job's shard messages).
    hour_end = _finished(sessions, hour["id"])
    with sessions() as session:
        after = [shard for shard in shards_of(session, week["id"]) if shard.started_at > hour_end]
    assert len(after) >= 12, f"only {len(after)} of 24 week shards ran after the hour job"

    # (b) Tenant A's big job, then tenant B's small one: B is served at once, between A's shards.
    big = client.submit(prompts(96, "big"), max_tokens=1)
    small = other_tenant.submit(prompts(8, "small"), max_tokens=1)
    assert other_tenant.wait(small["id"], poll_seconds=0.2, timeout=120)["status"] == "completed"
    assert client.wait(big["id"], poll_seconds=0.2, timeout=180)["status"] == "completed"
    small_end = _finished(sessions, small["id"])
    with sessions() as session:
        big_after = [shard for shard in shards_of(session, big["id"]) if shard.started_at > small_end]
    # B's 2 shards went in among A's first few, not after A's 24.
    assert len(big_after) >= 12, f"only {len(big_after)} of 24 shards of A ran after B's job"
    assert _first_shard_started(sessions, small["id"]) < _last_shard_done(sessions, big["id"])


def test_deadlines_the_quote_cannot_meet_and_bad_schedules(
    api_url: str, service_env: ServiceEnv, sessions, tmp_path: Path
) -> None:
    # Nobody serves the parked model: a measured rate of 0.1 s per output token prices the job. The row
    # is removed afterwards (tests/service/test_quote.py starts from a parked model with no profile).
    with sessions() as session:
        record_shard(
            session, model=PARKED_MODEL, worker_class=PROFILE_CLASS, work=ShardWork(4, 40, 800, 80.0, 800)
        )
    try:
        _late_jobs(api_url, service_env, tmp_path)
    finally:
        with sessions() as session:
            session.execute(delete(ThroughputProfile).where(ThroughputProfile.worker_class == PROFILE_CLASS))
            session.commit()


def _late_jobs(api_url: str, service_env: ServiceEnv, tmp_path: Path) -> None:
    key = create_api_key(service_env, "scheduling-strict")
    table = prompts(40, "late")
    with FreightClient(api_url, key) as client:
        quote = client.quote(table, model=PARKED_MODEL, max_tokens=200, completion_window="1m")
        assert quote["deadline_met"] is False and "after its deadline" in quote["deadline_warning"]
        with pytest.raises(FreightAPIError) as refused:
            client.submit(
                table, model=PARKED_MODEL, max_tokens=200, completion_window="1m", strict_deadline=True
            )
        assert refused.value.status_code == 422 and "strict_deadline" in str(refused.value)
        assert client.list_jobs(limit=10)["data"] == []  # nothing was stored
        for bad, where in (
            ({"completion_window": "2 weeks"}, "completion_window"),
            ({"completion_window": "400d"}, "completion_window"),
            ({"deadline": "tomorrow"}, "deadline"),
            ({"deadline": "2026-01-01T00:00:00"}, "UTC offset"),
            ({"deadline": "2020-01-01T00:00:00Z"}, "already passed"),
            ({"priority": "urgent"}, "priority"),
            ({"completion_window": "1h", "deadline": "2030-01-01T00:00:00Z"}, "not both"),
            ({"strict_deadline": True}, "strict_deadline"),
        ):
            with pytest.raises(FreightAPIError) as caught:
                client.submit(table, model=PARKED_MODEL, **bad)
            assert 400 <= caught.value.status_code < 500 and where in str(caught.value), (bad, caught.value)
        # Without strict_deadline the job is accepted with the quote's warning; the CLI's flags.
        source = tmp_path / "late.parquet"
        pq.write_table(table, source)
        out = tmp_path / "job.json"
        args = ["submit", str(source), "--api-url", api_url, "--api-key", key, "--model", PARKED_MODEL]
        args += ["--max-tokens", "200", "--window", "1m", "--priority", "low"]
        with open(out, "w") as sink, contextlib.redirect_stdout(sink):
            assert freight_main(args) == 0
        job = json.loads(out.read_text())
        assert job["priority"] == "low" and "after its deadline" in job["deadline_warning"]
        # the quote made at submission travels with the job object
        assert job["quote"]["rows"] == 40 and job["quote"]["deadline_met"] is False
        assert job["quote"]["deadline_warning"] == job["deadline_warning"]
        assert client.get_job(job["id"])["quote"] == job["quote"]
        due = datetime.fromisoformat(job["deadline"])
        assert timedelta(seconds=50) < due - datetime.now(UTC) <= timedelta(minutes=1)
        report = client.report_html(job["id"])
        assert "priority low" in report and "due " in report and "after its deadline" in report
        assert client.cancel(job["id"])["status"] == "cancelling"  # parked: nobody would run it


def test_a_failed_shard_waits_out_its_retry_delay_behind_other_tickets(
    client: FreightClient, worker: Process, sessions, service_env: ServiceEnv
) -> None:
    """A shard that fails runs again only after the retry delay (worker/retry.py), even with another job's
    tickets queued behind it: each of them claims the best free shard, and the failed one is not free
    until its delay is over (before, the next ticket retook it at once and its attempts ran back to back)."""
    model = service_env.settings.default_model
    poisoned = client.submit(prompts(2, "poison"), model=PARKED_MODEL, max_tokens=2)  # nobody runs these yet
    behind = client.submit(prompts(16, "behind"), model=PARKED_MODEL, max_tokens=2)
    with sessions() as session:
        # Parameters the engine refuses, planted in the database (no valid request makes them): every
        # attempt fails.
        for job, extra in ((poisoned, {"top_k": -1}), (behind, {})):
            params = {**job_store.get_job(session, job["id"]).params, **extra, "model": model}
            session.execute(update(Job).where(Job.id == job["id"]).values(params=params, model=model))
        session.commit()
    dispatcher = CeleryDispatcher(service_env.settings)
    dispatcher.dispatch(poisoned["id"], model, [0])
    dispatcher.dispatch(behind["id"], model, list(range(4)))
    assert client.wait(behind["id"], poll_seconds=0.2, timeout=120)["status"] == "completed"
    done = client.wait(poisoned["id"], poll_seconds=0.2, timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["failed"] == 2
    with sessions() as session:
        attempts = session.scalars(
            select(ShardAttempt).where(ShardAttempt.job_id == poisoned["id"]).order_by(ShardAttempt.started_at)
        ).all()
    assert [attempt.outcome for attempt in attempts] == ["retry", "retry", "failed"]
    delay = RetryPolicy.from_settings(service_env.settings).shard_delay_s
    gaps = [
        (later.started_at - earlier.updated_at).total_seconds()
        for earlier, later in zip(attempts, attempts[1:], strict=False)
    ]
    assert min(gaps) >= delay - 0.05, f"attempts {gaps} s apart; the retry delay is {delay} s"
