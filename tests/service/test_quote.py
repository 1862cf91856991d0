"""`POST /v1/jobs/quote` on a real `freight api` process, Postgres and Redis: a quote stores nothing
(no job row, no file, no queue message), refuses bad input exactly as a submission does, and prices the
job with the model's throughput profile, following it as finished shards change it."""

from __future__ import annotations

import glob
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from sqlalchemy import func, select

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.cli.main import main as freight_main
from jobs.domain.broker import queue_for_model
from jobs.domain.throughput import fit_rates
from storage.db import make_engine, make_session_factory
from storage.models import Job, JobEvent, Shard
from storage.profile_store import ShardWork, profiles_of, record_shard
from tests.service.fixtures import PARKED_MODEL, ServiceEnv, create_api_key

TENANT = "quotes"


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def prompts(rows: int) -> pa.Table:
    return pa.table({"prompt": [f"Tell me about the number {i}." for i in range(rows)]})


@pytest.fixture(scope="module")
def key(service_env: ServiceEnv) -> str:
    return create_api_key(service_env, TENANT)


@pytest.fixture
def quoter(api_url: str, key: str) -> Iterator[FreightClient]:
    with FreightClient(api_url, key) as client:
        yield client


@pytest.fixture(scope="module")
def sessions(service_env: ServiceEnv):
    engine = make_engine(service_env.settings.resolved_database_url)
    yield make_session_factory(engine)
    engine.dispose()


class Everything:
    """What a quote must leave as it was: every table a submission writes, every job file, the model's
    queue, and the API's temporary files."""

    def __init__(self, service: ServiceEnv, sessions) -> None:
        self.service, self.sessions = service, sessions
        self.broker = redis.Redis.from_url(service.settings.broker_url)

    def snapshot(self) -> dict:
        with self.sessions() as session:
            rows = {table.__tablename__: session.scalar(select(func.count()).select_from(table))
                    for table in (Job, Shard, JobEvent)}  # fmt: skip
        data = self.service.settings.resolved_data_dir
        queues = {model: self.broker.llen(queue_for_model(self.service.settings, model))
                  for model in self.service.settings.accepted_models()}  # fmt: skip
        return {
            "rows": rows,
            "files": sorted(str(path) for path in data.rglob("*") if path.is_file()) if data.exists() else [],
            "queues": queues,
            "temp": sorted(glob.glob(os.path.join(tempfile.gettempdir(), "freight-quote-*"))),
        }


def test_a_quote_stores_nothing_and_describes_the_job(
    quoter: FreightClient, service_env: ServiceEnv, sessions
) -> None:
    everything = Everything(service_env, sessions)
    before = everything.snapshot()
    table = pa.table({"prompt": ["one two three", "", "four five six seven", None, "eight"]})
    quote = quoter.quote(table, model=PARKED_MODEL, max_tokens=7)
    assert everything.snapshot() == before
    assert (quote["model"], quote["rows"], quote["rows_to_run"], quote["shards"]) == (PARKED_MODEL, 5, 3, 2)
    chars = len("one two three") + len("four five six seven") + len("eight")
    assert quote["prompt_chars"] == chars and quote["prompt_tokens_exact"] is False
    assert quote["output_tokens_max"] == 3 * 7 and quote["max_tokens"] == 7
    assert quote["device_hour_usd"] == service_env.settings.device_hour_usd
    assert quote["queue"]["workers"] >= 1
    # A row's own max_tokens counts for that row (the empty and null prompts' cells do not: they never run).
    with_column = table.append_column("max_tokens", pa.array([2, 50, 50, None, 3], pa.int64()))
    assert quoter.quote(with_column, model=PARKED_MODEL, max_tokens=7)["output_tokens_max"] == 2 + 50 + 3
    assert everything.snapshot() == before
    # The listing shows no job either.
    assert quoter.list_jobs(limit=100)["data"] == []


@pytest.mark.parametrize(
    ("content", "params"),
    [
        (b"this is not parquet", "{}"),
        (b"", "{}"),
        (None, "{not json"),
        (None, '["a list"]'),
        (None, ""),
        (None, '{"max_tokenz": 5}'),
        (None, '{"max_tokens": 0}'),
        (None, '{"max_tokens": 100000}'),
        (None, '{"model": "gpt-9"}'),
        (None, '{"template": "{nope}"}'),
        (None, '{"prompt_column": "text"}'),
        (parquet_bytes(pa.table({"custom_id": ["a", "a"], "prompt": ["x", "y"]})), "{}"),
        (parquet_bytes(pa.table({"text": ["x"]})), "{}"),
        (parquet_bytes(pa.table({"prompt": ["x"], "max_tokens": [100000]})), "{}"),
    ],
)
def test_bad_input_gets_the_same_answer_as_a_submission(
    api_url: str, key: str, service_env: ServiceEnv, sessions, content: bytes | None, params: str
) -> None:
    content = parquet_bytes(prompts(2)) if content is None else content
    headers = {"Authorization": f"Bearer {key}"}
    everything = Everything(service_env, sessions)
    before = everything.snapshot()
    answers = [
        httpx.post(
            f"{api_url}{path}",
            headers=headers,
            files={"file": ("x.parquet", content)},
            data={"params": params},
        )
        for path in ("/v1/jobs/quote", "/v1/jobs")
    ]
    quoted, submitted = answers
    assert 400 <= submitted.status_code < 500, submitted.text
    assert (quoted.status_code, quoted.json()) == (submitted.status_code, submitted.json())
    assert everything.snapshot() == before


def test_a_quote_needs_a_key_and_a_file(api_url: str, key: str) -> None:
    files = {"file": ("x.parquet", parquet_bytes(prompts(1)))}
    assert httpx.post(f"{api_url}/v1/jobs/quote", files=files).status_code == 401
    missing = httpx.post(f"{api_url}/v1/jobs/quote", headers={"Authorization": f"Bearer {key}"}, data={})
    same = httpx.post(f"{api_url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, data={})
    assert (missing.status_code, missing.json()) == (same.status_code, same.json())
    assert 400 <= missing.status_code < 500


def test_a_quote_over_the_upload_limit_is_a_413(quoter: FreightClient) -> None:
    big = pa.table({"prompt": [os.urandom(1500).hex() for _ in range(1000)]})
    with pytest.raises(FreightAPIError) as caught:
        quoter.quote(big, model=PARKED_MODEL)
    assert caught.value.status_code == 413


def test_device_seconds_follow_the_models_profile(
    quoter: FreightClient, sessions, service_env: ServiceEnv
) -> None:
    table = prompts(8)
    with sessions() as session:
        assert profiles_of(session, model=PARKED_MODEL) == []  # no worker serves it: only this test adds
    unpriced = quoter.quote(table, model=PARKED_MODEL, max_tokens=20)
    assert (
        unpriced["device_seconds"] is None
        and unpriced["cost_usd"] is None
        and unpriced["eta_seconds"] is None
    )
    assert PARKED_MODEL in unpriced["device_seconds_unknown_reason"]
    assert unpriced["output_tokens_basis"] == "max_tokens"

    def priced() -> tuple[dict, float]:
        quote = quoter.quote(table, model=PARKED_MODEL, max_tokens=20)
        with sessions() as session:
            rates = fit_rates(profiles_of(session, model=PARKED_MODEL))
        return quote, rates.device_seconds(quote["prompt_tokens"], quote["output_tokens_expected"])

    # Two shard shapes: 0.002 s per prompt token and 0.05 s per output token; rows used half their cap.
    with sessions() as session:
        record_shard(
            session, model=PARKED_MODEL, worker_class="avx2", work=ShardWork(4, 400, 40, 2.8, 4 * 20)
        )
        record_shard(
            session, model=PARKED_MODEL, worker_class="avx2", work=ShardWork(4, 100, 40, 2.2, 4 * 20)
        )
    first, expected = priced()
    assert first["throughput"]["fit"] == "least_squares"
    assert first["throughput"]["prompt_tokens_per_second"] == pytest.approx(500)
    assert first["throughput"]["output_tokens_per_second"] == pytest.approx(20)
    assert first["output_tokens_basis"] == "history"
    assert first["output_tokens_expected"] == round(8 * 20 * 80 / 160)
    assert first["device_seconds"] == pytest.approx(expected, abs=1e-3)
    price = service_env.settings.device_hour_usd
    assert first["cost_usd"] == pytest.approx(first["device_seconds"] / 3600 * price, rel=1e-4)
    queue = first["queue"]
    assert (queue["workers"], queue["workers_source"]) == (
        service_env.settings.quote_assumed_workers,
        "setting",
    )
    assert first["eta_seconds"] == pytest.approx(
        queue["backlog_device_seconds"] / queue["workers"] + first["device_seconds"] / queue["workers"],
        abs=0.01,
    )

    # Slower machines join the fleet: every shard they finish raises the quote.
    with sessions() as session:
        for _ in range(2):
            record_shard(
                session, model=PARKED_MODEL, worker_class="slow", work=ShardWork(4, 400, 40, 8.4, 4 * 20)
            )
            record_shard(
                session, model=PARKED_MODEL, worker_class="slow", work=ShardWork(4, 100, 40, 6.6, 4 * 20)
            )
    second, expected = priced()
    assert second["device_seconds"] == pytest.approx(expected, abs=1e-3)
    assert second["device_seconds"] > first["device_seconds"]
    assert sorted(second["throughput"]["worker_classes"]) == ["avx2", "slow"]
    assert second["throughput"]["shards_measured"] == 6


def test_freight_quote_prints_the_quote(
    api_url: str, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "input.parquet"
    pq.write_table(prompts(3), source)
    code = freight_main(
        [
            "quote",
            str(source),
            "--api-url",
            api_url,
            "--api-key",
            key,
            "--model",
            PARKED_MODEL,
            "--max-tokens",
            "9",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    quote = json.loads(out)
    assert (quote["rows"], quote["output_tokens_max"]) == (3, 27)
    assert "3 rows" in err
    assert (
        freight_main(["quote", str(source), "--api-url", api_url, "--api-key", key, "--max-tokens", "0"]) != 0
    )


def test_a_quote_counts_prompt_tokens_with_the_models_tokenizer(
    quoter: FreightClient, service_env: ServiceEnv, tiny_llama_dir: Path
) -> None:
    """The default model's files are on the API's host: the API's grammar-check child counts the prompt
    tokens as the worker will (worker/engine/prompt_ids.py: here the chat template); the parked model's
    are not (the quote above estimates from characters)."""
    from transformers import AutoTokenizer

    from worker.engine.prompt_ids import prompt_token_ids

    texts = ["one two three", "Summarize: the cat sat on the mat.", "ünïcödé ✓"]
    quote = quoter.quote(pa.table({"prompt": texts}), max_tokens=7, chat=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [[{"role": "user", "content": text}] for text in texts]
    context = service_env.settings.max_model_len
    expected = prompt_token_ids(tokenizer, messages, max_model_len=context, budgets=[None] * len(texts))
    assert quote["prompt_tokens_exact"] is True
    assert quote["prompt_tokens"] == sum(map(len, expected))
    assert quote["prompt_tokens"] != -(-quote["prompt_chars"] // 4)  # not the estimate
