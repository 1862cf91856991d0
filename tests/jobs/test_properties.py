"""Property: whatever Parquet table and params a client sends, the API answers either a 4xx with a
message (leaving no job and no file) or 201 with a job that, run to the end, has exactly one result
per input row, whose only error rows are the per-row kinds (null, empty or too-long prompts).

Hypothesis draws the tables (column types, nulls, control characters, duplicate ids, per-row
overrides) and the params (valid, out of range, unknown, not JSON). The API is the real app over
HTTP in-process (FastAPI's TestClient) on Postgres; accepted jobs run through the real shard runner
and engine (tiny model, 128-token context, so long prompts happen) and finalize."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from jobs.api.app import create_app
from jobs.domain.settings import Settings
from storage.blobs import BlobStore, results_name
from storage.db import make_engine, make_session_factory
from storage.keys import create_key
from storage.models import Job
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.shard.context import WorkerContext
from worker.shard.executor import run_shard

TENANT = "property"
MAX_LEN = 128
PER_ROW_PROBLEMS = (
    "empty prompt",
    "is null",
    "tokens; the model's context is",
    "messages is null",
    "every message",
)

texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=300)
short_ints = st.integers(-2, 10) | st.sampled_from([0, MAX_LEN - 1, MAX_LEN, 2**31, -(2**40)])
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.1])


def nullable(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), values)


def column(draw: st.DrawFn, values: st.SearchStrategy, rows: int, arrow_type: pa.DataType) -> pa.Array:
    return pa.array(draw(st.lists(values, min_size=rows, max_size=rows)), arrow_type)


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    """Mostly tables a user could mean (valid types, odd values); one in four has broken columns."""
    rows = 0 if draw(st.integers(0, 19)) == 0 else draw(st.integers(1, 6))
    wild = draw(st.integers(0, 3)) == 0
    columns: dict[str, pa.Array] = {}
    prompt_kind = draw(st.sampled_from(["string", "int", "binary", "list", "none"])) if wild else "string"
    name = draw(st.sampled_from(["prompt", "text"])) if wild else "prompt"
    if prompt_kind == "string":
        columns[name] = column(draw, nullable(texts), rows, pa.string())
    elif prompt_kind == "int":
        columns[name] = column(draw, st.integers(-5, 5), rows, pa.int64())
    elif prompt_kind == "binary":
        columns[name] = column(draw, st.binary(max_size=8), rows, pa.binary())
    elif prompt_kind == "list":
        columns[name] = column(draw, st.lists(texts, max_size=2), rows, pa.list_(pa.string()))
    id_kind = draw(st.sampled_from(["none", "unique", "any", "int"] if wild else ["none", "unique"]))
    if id_kind == "unique":
        ids = draw(
            st.lists(texts.filter(lambda t: "\x00" not in t), min_size=rows, max_size=rows, unique=True)
        )
        columns["custom_id"] = pa.array(ids, pa.string())
    elif id_kind == "any":
        columns["custom_id"] = column(draw, nullable(texts), rows, pa.string())
    elif id_kind == "int":
        columns["custom_id"] = pa.array(range(rows), pa.int64())
    max_tokens = short_ints if wild else st.integers(1, 8)
    temperature = floats if wild else st.floats(0, 2)
    top_p = floats if wild else st.floats(0.05, 1)
    for name_, values, arrow_type in (
        ("max_tokens", max_tokens, pa.int64()),
        ("temperature", temperature, pa.float64()),
        ("top_p", top_p, pa.float64()),
        ("seed", st.integers(-(2**63), 2**63 - 1), pa.int64()),
        ("title", texts, pa.string()),
    ):
        if draw(st.integers(0, 3)) == 0:
            columns[name_] = column(draw, nullable(values), rows, arrow_type)
    if not columns:
        columns["other"] = pa.array(range(rows), pa.int64())
    return pa.table(columns)


WILD_PARAMS: dict[str, st.SearchStrategy] = {
    "max_tokens": short_ints | st.just("many"),
    "temperature": floats,
    "top_p": floats,
    "top_k": st.integers(-1, 60),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.lists(texts, max_size=3) | texts,
    "template": st.sampled_from(
        ["{text}", "{prompt}", "{title}: {prompt}", "{missing}", "{0}", "x", "{prompt!r}"]
    ),
    "prompt_column": st.sampled_from(["prompt", "text", "title", "custom_id", "nope"]),
    "metadata": st.dictionaries(texts, texts | st.integers(), max_size=3),
    "quantization": st.sampled_from(["int8", "none", "int4"]),
    "kv_cache_dtype": st.sampled_from(["int8", "auto", "float32", "int4"]),
    "model": st.sampled_from(["gpt-9", "../model"]),
    "unknown_option": st.integers(),
}
USUAL_PARAMS: dict[str, st.SearchStrategy] = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=2),
    "template": st.sampled_from(["{prompt}", "Q: {prompt}\nA:"]),
    "chat": st.booleans(),
    "truncate": st.booleans(),
    "metadata": st.dictionaries(
        st.text(min_size=1, max_size=10).filter(lambda t: "\x00" not in t),
        st.text(max_size=20).filter(lambda t: "\x00" not in t),
        max_size=3,
    ),
    "quantization": st.sampled_from(["int8", "none"]),
    "kv_cache_dtype": st.sampled_from(["int8", "auto", "float32"]),
}


@st.composite
def raw_params(draw: st.DrawFn) -> str:
    """The params form field: mostly sensible choices, one in four with wild ones, a few not JSON."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from(["{not json", "[]", "null", '"text"', ""]))
    choices = WILD_PARAMS if draw(st.integers(0, 3)) == 0 else USUAL_PARAMS
    names = draw(st.lists(st.sampled_from(sorted(choices)), max_size=4, unique=True))
    params = {name: draw(choices[name]) for name in names}
    params.setdefault("max_tokens", draw(st.integers(1, 6)))
    return json.dumps(params)  # NaN and Infinity come out as the bare words Python's json reads back


@pytest.fixture(scope="module")
def service(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
) -> Iterator[dict[str, Any]]:
    settings_ = Settings(
        database_url=pg_url,
        broker_url=None,
        home=tmp_path_factory.mktemp("prop-home"),
        data_dir=tmp_path_factory.mktemp("prop-data"),
        default_model=str(tiny_llama_dir),
        models=[str(tiny_llama_dir)],
        shard_size=3,
        max_model_len=MAX_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        kv_cache_memory_gb=0.05,
        num_threads=1,
        shard_max_attempts=1,  # a shard that fails is a finding, not something to retry
        max_upload_mb=1,
    )
    engine = make_engine(pg_url)
    sessions = make_session_factory(engine)
    with sessions() as session:
        key = create_key(session, TENANT).key
    ctx = WorkerContext(settings=settings_, sessions=sessions, blobs=BlobStore(settings_.resolved_data_dir))
    with TestClient(create_app(settings_)) as http:
        http.headers["Authorization"] = f"Bearer {key}"
        yield {"http": http, "ctx": ctx, "pool": LLMPool(settings_)}
    engine.dispose()


def tenant_jobs(ctx: WorkerContext) -> int:
    with ctx.sessions() as session:
        return session.scalar(select(func.count()).select_from(Job).where(Job.tenant == TENANT))


def expected_custom_ids(table: pa.Table) -> list[str]:
    if "custom_id" in table.column_names:
        return table.column("custom_id").to_pylist()
    return [str(i) for i in range(table.num_rows)]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(table=tables(), params=raw_params(), cut=st.integers(0, 19))
def test_any_table_and_params_give_a_4xx_or_one_result_per_row(
    service: dict[str, Any], table: pa.Table, params: str, cut: int
) -> None:
    http, ctx, pool = service["http"], service["ctx"], service["pool"]
    sink = io.BytesIO()
    pq.write_table(table, sink)
    content = sink.getvalue()
    if cut == 0:  # now and then the upload is cut short
        content = content[: len(content) // 2]
    jobs_before = tenant_jobs(ctx)
    dirs_before = set((ctx.blobs.root / "jobs").glob("*"))
    response = http.post("/v1/jobs", files={"file": ("in.parquet", content)}, data={"params": params})
    event(f"HTTP {response.status_code}")

    if response.status_code != 201:
        assert 400 <= response.status_code < 500, response.text
        body = response.json()
        error = body["error"]  # one shape for every 4xx
        assert error["message"].strip() and error["type"] and error["code"], body
        assert tenant_jobs(ctx) == jobs_before
        assert set((ctx.blobs.root / "jobs").glob("*")) == dirs_before
        return

    job = response.json()
    assert job["request_counts"]["total"] == table.num_rows
    shards = math.ceil(table.num_rows / ctx.settings.shard_size)
    for index in range(shards):
        outcome = run_shard(ctx, pool, job["id"], index)
        assert outcome.status == "done", outcome
    assert finalize_job(ctx, job["id"]) == "completed"
    rows = pq.read_table(ctx.blobs.path(results_name(job["id"]))).to_pylist()
    assert [row["row_index"] for row in rows] == list(range(table.num_rows))
    assert [row["custom_id"] for row in rows] == expected_custom_ids(table)
    event(f"ran {len(rows)} rows, {sum(row['finish_reason'] == 'error' for row in rows)} error rows")
    for row in rows:
        if row["finish_reason"] == "error":
            assert any(problem in row["error"] for problem in PER_ROW_PROBLEMS), row
        else:
            assert row["finish_reason"] in ("stop", "length") and row["error"] is None, row
            assert row["prompt_tokens"] + row["output_tokens"] <= MAX_LEN
