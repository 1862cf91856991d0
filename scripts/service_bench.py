"""What the service costs in throughput: the same rows through API + Celery + Postgres and through the
engine alone, plus result rows written to Postgres per second.

    .venv/bin/python scripts/service_bench.py --rows 2000 --max-tokens 16 \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/freight_bench --broker-url redis://127.0.0.1:6379/9

The database must be migrated (`freight db upgrade`); `freight api` and `freight worker` are started
here as subprocesses with the same settings, and stopped at the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from jobs.cli.client import FreightClient  # noqa: E402
from jobs.domain.sample_docs import DOCUMENTS, SUMMARIZE_TEMPLATE  # noqa: E402
from jobs.domain.settings import Settings  # noqa: E402
from scripts.load_bench import wait_ready  # noqa: E402
from storage import job_store  # noqa: E402
from storage.db import make_engine, make_session_factory  # noqa: E402
from storage.keys import create_key  # noqa: E402
from storage.result_store import insert_results  # noqa: E402


def bench_rows(count: int) -> pa.Table:
    """Documents cut at varied lengths, so shards have something to sort."""
    texts = []
    for i in range(count):
        _doc_id, _title, text = DOCUMENTS[i % len(DOCUMENTS)]
        texts.append(text[: 80 + (i * 37) % max(1, len(text) - 80)])
    return pa.table({"custom_id": [f"r{i}" for i in range(count)], "text": texts})


def engine_alone(settings: Settings, table: pa.Table, max_tokens: int) -> dict:
    from worker.engine import SamplingParams
    from worker.llm_pool import LLMPool

    llm = LLMPool(settings).load(LLMPool(settings).default_key(settings.default_model))
    prompts = [
        llm.encode(
            llm.apply_chat_template([{"role": "user", "content": SUMMARIZE_TEMPLATE.format(text=t)}]),
            add_special_tokens=False,
        )
        for t in table.column("text").to_pylist()
    ]
    prompts.sort(key=len)
    llm.generate(prompts[:8], SamplingParams(max_tokens=2))  # warm up, as the worker is by its first shard
    started = time.monotonic()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    seconds = time.monotonic() - started
    tokens = sum(len(o.prompt_token_ids) + len(o.output_token_ids) for o in outputs)
    return {
        "seconds": round(seconds, 2),
        "rows_per_s": round(len(outputs) / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def through_service(
    settings: Settings, env: dict[str, str], table: pa.Table, max_tokens: int, log_dir: Path
) -> dict:
    freight = str(Path(sys.executable).with_name("freight"))
    port = _free_port()
    processes = [
        subprocess.Popen(
            [freight, "api", "--port", str(port)],
            env=env,
            stdout=open(log_dir / "api.log", "wb"),
            stderr=subprocess.STDOUT,
        ),  # noqa: SIM115
        subprocess.Popen(
            [freight, "worker"], env=env, stdout=open(log_dir / "worker.log", "wb"), stderr=subprocess.STDOUT
        ),  # noqa: SIM115
    ]
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        engine = make_engine(settings.resolved_database_url)
        with make_session_factory(engine)() as session:
            key = create_key(session, "bench").key
        engine.dispose()
        _wait_for_worker(settings)  # the worker loads its model before the clock starts
        with FreightClient(base, key) as client:
            submitted = time.monotonic()
            job = client.submit(table, max_tokens=max_tokens, template=SUMMARIZE_TEMPLATE)
            done = client.wait(job["id"], poll_seconds=0.5)
            end_to_end = time.monotonic() - submitted
            metrics = client.metrics(job["id"])
        tokens = metrics["prompt_tokens"] + metrics["output_tokens"]
        return {
            "status": done["status"],
            "end_to_end_seconds": round(end_to_end, 2),
            "rows_per_s": round(metrics["rows"] / end_to_end, 2),
            "tokens_per_s": round(tokens / end_to_end, 1),
            "metrics": metrics,
        }
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(60)


def _wait_for_worker(settings: Settings, timeout_s: float = 600) -> None:
    from celery import Celery

    from jobs.domain.broker import celery_config

    control = Celery("freight-bench", set_as_current=False)
    control.conf.update(celery_config(settings))
    deadline = time.monotonic() + timeout_s
    while not control.control.ping(timeout=1.0):
        if time.monotonic() > deadline:
            raise TimeoutError("no worker answered")
    control.close()


def postgres_insert_rate(settings: Settings, rows: int) -> dict:
    engine = make_engine(settings.resolved_database_url)
    sessions = make_session_factory(engine)
    job_id = job_store.new_job_id()
    with sessions() as session:
        job_store.create_job(
            session, job_id=job_id, tenant="bench", model="m", params={}, metadata={}, input_name="x"
        )
    row = {
        "output_text": "x" * 200,
        "prompt_tokens": 100,
        "output_tokens": 50,
        "finish_reason": "stop",
        "error": None,
    }
    started = time.monotonic()
    chunk = settings.result_chunk_rows
    for start in range(0, rows, chunk):
        batch = [
            {"job_id": job_id, "shard_index": 0, "row_index": i, "custom_id": f"r{i}", **row}
            for i in range(start, min(rows, start + chunk))
        ]
        with sessions() as session:
            insert_results(session, batch)
    seconds = time.monotonic() - started
    with sessions() as session:
        job_store.delete_job(session, job_id)
    engine.dispose()
    return {"rows": rows, "chunk_rows": chunk, "rows_per_s": round(rows / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    args = parser.parse_args(argv)
    env = {**os.environ, "FREIGHT_DATABASE_URL": args.database_url, "FREIGHT_BROKER_URL": args.broker_url}
    os.environ.update(env)
    settings = Settings()
    table = bench_rows(args.rows)
    with tempfile.TemporaryDirectory() as logs:
        service = through_service(settings, env, table, args.max_tokens, Path(logs))
    alone = engine_alone(settings, table, args.max_tokens)
    report = {
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "engine_alone": alone,
        "service": service,
        "service_overhead_pct": round(100 * (1 - service["tokens_per_s"] / alone["tokens_per_s"]), 1),
        "postgres_result_inserts": postgres_insert_rate(settings, max(args.rows, 2000)),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
