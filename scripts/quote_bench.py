"""How good is the quote? Quoted against actual prompt tokens, output tokens, device-seconds, cost and time
to done, for a few held-out jobs through `freight api` and one `freight worker`: first on a cold queue
(nothing else queued), then each again on a queue already holding another job of the same tenant and
priority (submitted just before: the quote's ETA counts it as backlog).

    .venv/bin/python scripts/quote_bench.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/freight_quote \\
        --broker-url redis://127.0.0.1:6379/9 [--model smollm2-135m] [--rows 48]

The database is created if missing and migrated here. Before the held-out jobs, two training jobs of
different shapes (short prompts with long outputs, long prompts with short outputs) give the model's
throughput profile its first shards, so the quote has measured rates to price with (docs/jobs.md). Prompt
tokens are counted exactly by the API's grammar-check child when the model's files are on this host.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benches' helpers

from fair_share_bench import ensure_database  # noqa: E402
from load_bench import _free_port, _wait_for_worker, stop_all, wait_ready  # noqa: E402

from jobs.cli.client import FreightClient  # noqa: E402
from jobs.domain.sample_docs import SUMMARIZE_TEMPLATE, sample_docs_table  # noqa: E402
from jobs.domain.settings import Settings  # noqa: E402
from storage.db import make_engine, make_session_factory, upgrade  # noqa: E402
from storage.keys import create_key  # noqa: E402

WORDS = "the quick brown fox jumps over the lazy dog while a small cat watches from the old stone wall".split()


def sentences(rows: int, words: int, tag: str) -> pa.Table:
    return pa.table(
        {"prompt": [f"{tag} {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) for i in range(rows)]}
    )


def jobs(rows: int) -> dict[str, tuple[pa.Table, dict]]:
    """name -> (input, params): two training shapes, then the held-out jobs (other shapes, a template,
    the chat template, per-row max_tokens)."""
    docs = sample_docs_table()
    docs = pa.concat_tables([docs] * (rows // docs.num_rows + 1)).slice(0, rows)
    fresh = {"reuse_results": False}  # the same rows run again in the busy round: no result cache
    return {
        "train_short_prompts": (sentences(rows, 6, "Continue"), {"max_tokens": 48, **fresh}),
        "train_long_prompts": (sentences(rows, 120, "Repeat"), {"max_tokens": 8, **fresh}),
        "held_questions_chat": (sentences(rows, 12, "Answer briefly"), {"max_tokens": 24, "chat": True, **fresh}),
        "held_docs_summary": (docs.select(["text"]), {"max_tokens": 32, "template": SUMMARIZE_TEMPLATE, **fresh}),
        "held_mixed_max_tokens": (
            sentences(rows, 30, "Explain").append_column("max_tokens", pa.array([4 + i % 40 for i in range(rows)])),
            {"max_tokens": 40, **fresh},
        ),
    }


def seconds_between(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def measured(client: FreightClient, table_path: Path, params: dict, timeout: float) -> dict:
    """Quote the job, submit it, wait for it: the quote beside what it took. Every job runs all its rows
    (`reuse_results` false): a rerun would otherwise come from the result cache, which the quote does not
    foresee."""
    quote = client.quote(table_path, **params)
    job = client.submit(table_path, **params)
    done = client.wait(job["id"], poll_seconds=0.2, timeout=timeout)
    metrics = client.metrics(job["id"])
    return {
        "status": done["status"],
        "rows": quote["rows"],
        "prompt_tokens_exact": quote["prompt_tokens_exact"],
        "prompt_tokens": [quote["prompt_tokens"], metrics["prompt_tokens"]],
        "output_tokens": [quote["output_tokens_expected"], metrics["output_tokens"]],
        "device_seconds": [quote["device_seconds"], metrics["device_seconds"]],
        "cost_usd": [quote["cost_usd"], metrics["cost_usd"]],
        "eta_seconds": [quote["eta_seconds"], round(seconds_between(job["created_at"], done["finished_at"]), 2)],
        "backlog_rows": quote["queue"]["backlog_rows"],
        "workers": quote["queue"]["workers"],
    }


def run(args: argparse.Namespace, workdir: Path) -> dict:
    env = {
        **os.environ,
        "FREIGHT_DATABASE_URL": args.database_url,
        "FREIGHT_BROKER_URL": args.broker_url,
        "FREIGHT_DATA_DIR": str(workdir / "data"),
        "FREIGHT_QUEUE_PREFIX": f"freight-quote-{os.getpid()}",
        "FREIGHT_SHARD_SIZE": str(args.shard_size),
        "FREIGHT_NUM_THREADS": str(args.threads),
        "FREIGHT_MAX_MODEL_LEN": "1024",
        "FREIGHT_DEFAULT_MODEL": args.model,
        "FREIGHT_MODELS": json.dumps([args.model]),
        "FREIGHT_QUOTE_ASSUMED_WORKERS": "1",
    }
    os.environ.update(env)
    settings = Settings()
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        key = create_key(session, "quote-bench").key
    engine.dispose()
    inputs = {}
    for name, (table, params) in jobs(args.rows).items():
        pq.write_table(table, workdir / f"{name}.parquet")
        inputs[name] = (workdir / f"{name}.parquet", params)
    freight = str(Path(sys.executable).with_name("freight"))
    port = _free_port()
    logs = [open(workdir / name, "wb") for name in ("api.log", "worker.log")]  # noqa: SIM115
    api = subprocess.Popen([freight, "api", "--port", str(port)], env=env, stdout=logs[0], stderr=subprocess.STDOUT)
    worker = subprocess.Popen([freight, "worker"], env=env, stdout=logs[1], stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        _wait_for_worker(settings)
        results: dict[str, dict] = {}
        with FreightClient(base, key, timeout=600) as client:
            for name in ("train_short_prompts", "train_long_prompts"):
                path, params = inputs[name]
                job = client.submit(path, **params)
                client.wait(job["id"], poll_seconds=0.5, timeout=args.timeout)
            held = [name for name in inputs if name.startswith("held_")]
            for name in held:
                path, params = inputs[name]
                results[f"{name}/cold"] = measured(client, path, params, args.timeout)
            for name in held:
                # The queue already holds another job (the same tenant and class: it goes first).
                blocker_path, blocker_params = inputs["train_short_prompts"]
                blocker = client.submit(blocker_path, **blocker_params)
                path, params = inputs[name]
                results[f"{name}/busy"] = measured(client, path, params, args.timeout)
                client.wait(blocker["id"], poll_seconds=0.5, timeout=args.timeout)
        return {"model": args.model, "rows": args.rows, "shard_size": args.shard_size, "jobs": results}
    finally:
        stop_all([api, worker], logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=48, help="rows of each job")
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, inputs)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="freight-quote-bench-"))
    try:
        ensure_database(args.database_url)
        os.environ["FREIGHT_DATABASE_URL"] = args.database_url
        upgrade(args.database_url)
        report = run(args, workdir)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
