"""The result cache (docs/result-cache.md) on a real `freight api`, `freight worker`, Postgres and Redis:
a rerun with a few changed rows runs only those on the engine and reuses the rest (the metrics and the
rows say so); reused rows equal a rerun bit for bit in the batch-invariant mode; tenants never share
entries; unseeded sampling does not reuse by default."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from sqlalchemy import select

from jobs.cli.client import FreightClient
from jobs.domain.result_cache import reuses_result
from storage.db import make_engine, make_session_factory
from storage.models import Shard
from tests.service.fixtures import Process, ServiceEnv, create_api_key

ROWS = 8


def rows(changed: dict[int, str] | None = None) -> pa.Table:
    prompts = [f"Result cache row {i}: tell me about the number {i}." for i in range(ROWS)]
    for index, text in (changed or {}).items():
        prompts[index] = text
    return pa.table({"custom_id": [f"r{i}" for i in range(ROWS)], "prompt": prompts})


@pytest.fixture(scope="module")
def clients(api_url: str, service_env: ServiceEnv) -> Iterator[dict[str, FreightClient]]:
    """Clients of tenants of their own: no other test's rows are in their caches."""
    made = {tenant: FreightClient(api_url, create_api_key(service_env, tenant)) for tenant in ("ca", "cb", "cc")}
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def sessions(service_env: ServiceEnv):
    engine = make_engine(service_env.settings.resolved_database_url)
    yield make_session_factory(engine)
    engine.dispose()


def run(client: FreightClient, table: pa.Table, **params: Any) -> tuple[dict, list[dict]]:
    """Submit, wait, and return the job's metrics and result rows."""
    job = client.submit(table, max_tokens=3, **params)
    done = client.wait(job["id"], poll_seconds=0.2, timeout=300)
    assert done["status"] == "completed", done
    return client.metrics(job["id"]), client.results_table(job["id"]).to_pylist()


def rows_run(sessions, job_id: str) -> int:
    """Rows the engine ran for the job (each finished shard's stats say how many of its rows)."""
    with sessions() as session:
        stats = session.scalars(select(Shard.stats).where(Shard.job_id == job_id))
        return sum(int(stat["rows_run"]) for stat in stats)


def output(row: dict) -> tuple:
    return row["output_text"], row["prompt_tokens"], row["output_tokens"], row["finish_reason"], row["error"]


def test_a_rerun_reuses_unchanged_rows_of_its_tenant_only(
    clients: dict[str, FreightClient], worker: Process, sessions
) -> None:
    first_metrics, first = run(clients["ca"], rows())
    assert first_metrics["cached_rows"] == 0 and not any(row["cached"] for row in first)
    assert all(row["finish_reason"] in ("stop", "length") for row in first)

    changed = {1: "A different prompt for row one.", 6: "And another one for row six."}
    job = clients["ca"].submit(rows(changed), max_tokens=3)
    assert clients["ca"].wait(job["id"], poll_seconds=0.2, timeout=300)["status"] == "completed"
    metrics, second = clients["ca"].metrics(job["id"]), clients["ca"].results_table(job["id"]).to_pylist()
    unchanged = [i for i in range(ROWS) if i not in changed]
    assert metrics["cached_rows"] == len(unchanged)
    assert rows_run(sessions, job["id"]) == len(changed)  # the engine ran the changed rows only
    assert [row["cached"] for row in second] == [i not in changed for i in range(ROWS)]
    for i in unchanged:
        assert output(second[i]) == output(first[i])
    assert metrics["saved_output_tokens"] == sum(first[i]["output_tokens"] for i in unchanged)
    assert metrics["saved_prompt_tokens"] == sum(first[i]["prompt_tokens"] for i in unchanged)
    assert 0 < metrics["saved_device_seconds"] <= first_metrics["device_seconds"]
    assert metrics["rows_completed"] == ROWS  # cached rows are completed rows
    assert f'data-key="cached_rows">{len(unchanged)}<' in clients["ca"].report_html(job["id"])

    # Another tenant's identical job runs every row.
    other, _ = run(clients["cb"], rows())
    assert other["cached_rows"] == 0

    # Sampling without a seed draws afresh by default: the same job twice reuses nothing.
    run(clients["ca"], rows(), temperature=0.8)
    unseeded, _ = run(clients["ca"], rows(), temperature=0.8)
    assert unseeded["cached_rows"] == 0


def test_reused_rows_equal_a_rerun_bit_for_bit_in_the_batch_invariant_mode(
    clients: dict[str, FreightClient], worker: Process, sessions, tiny_llama_dir
) -> None:
    from worker.engine import LLM

    exact = {"dtype": "float32", "quantization": "none"}
    # float32 without quantization on CPU is the batch-invariant mode (docs/engine.md)
    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization=None, max_model_len=512, kv_cache_memory_gb=0.05)
    assert llm.numerics.batch_invariant
    llm.close()

    run(clients["cc"], rows(), **exact)
    changed = {0: "Row zero, changed.", 5: "Row five, changed as well."}
    reused_metrics, reused = run(clients["cc"], rows(changed), **exact)
    rerun_metrics, rerun = run(clients["cc"], rows(changed), reuse_results=False, **exact)
    assert reused_metrics["cached_rows"] == ROWS - len(changed) and rerun_metrics["cached_rows"] == 0
    assert not any(row["cached"] for row in rerun)
    assert [output(row) for row in reused] == [output(row) for row in rerun]


def test_the_default_rule() -> None:
    assert reuses_result(None, temperature=0.0, seed=None)  # greedy
    assert reuses_result(None, temperature=0.7, seed=3)  # seeded sampling
    assert not reuses_result(None, temperature=0.7, seed=None)  # a fresh draw
    assert reuses_result(True, temperature=0.7, seed=None) and not reuses_result(False, temperature=0.0, seed=1)
