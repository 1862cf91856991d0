"""Memory under load: one big job (200,000 short prompts, max_tokens 1 by default) through `freight api`
and one `freight worker`, sampling the resident memory (RSS) of both processes the whole time.

    .venv/bin/python scripts/load_bench.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/freight_load \\
        --broker-url redis://127.0.0.1:6379/9 [--rows 200000] [--model PATH]

The database is migrated here. Without --model a tiny random-weight Llama (2 layers, hidden 64) with
SmolLM2's tokenizer is built in a temp folder: the point is the service's memory, not the model's.
Prints one JSON object: submit seconds (upload, validation, sharding and enqueueing, until the 201),
total seconds (until the job completed), and the peak RSS of the API and of the worker.
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

import httpx
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from jobs.cli.client import FreightClient  # noqa: E402
from jobs.domain.settings import Settings  # noqa: E402
from storage.db import make_engine, make_session_factory, upgrade  # noqa: E402
from storage.keys import create_key  # noqa: E402
from worker.bench.peak_rss import MB, PeakRSS  # noqa: E402


def tiny_model(out_dir: Path, settings: Settings) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from worker.engine.loader import pull_model

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(pull_model("smollm2-135m", settings.models_dir)).save_pretrained(out_dir)
    return out_dir


def input_file(path: Path, rows: int) -> Path:
    table = pa.table(
        {
            "custom_id": [f"r{i}" for i in range(rows)],
            "prompt": [f"Question {i}: what is {i % 97} plus {i % 89}?" for i in range(rows)],
        }
    )
    pq.write_table(table, path, row_group_size=16384)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base: str, tries: int = 600) -> None:
    """Until the API at `base` answers /readyz (a start that never gets there shows in the next request)."""
    for _ in range(tries):
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def stop_all(processes: list[subprocess.Popen | None], logs: list) -> None:
    """SIGTERM every process started, wait up to 60 s for each (then kill it), close the logs."""
    started = [process for process in processes if process is not None]
    for process in started:
        process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    for log in logs:
        log.close()


def _wait_for_worker(settings: Settings, timeout_s: float = 600) -> None:
    from celery import Celery

    from jobs.domain.broker import celery_config

    control = Celery("freight-load-bench", set_as_current=False)
    control.conf.update(celery_config(settings))
    deadline = time.monotonic() + timeout_s
    while not control.control.ping(timeout=1.0):
        if time.monotonic() > deadline:
            raise TimeoutError("no worker answered")
    control.close()


def run(args: argparse.Namespace, workdir: Path) -> dict:
    env = {
        **os.environ,
        "FREIGHT_DATABASE_URL": args.database_url,
        "FREIGHT_BROKER_URL": args.broker_url,
        "FREIGHT_DATA_DIR": str(workdir / "data"),
        "FREIGHT_QUEUE_PREFIX": f"freight-load-{os.getpid()}",
        "FREIGHT_SHARD_SIZE": str(args.shard_size),
        "FREIGHT_MAX_UPLOAD_MB": "1024",
        "FREIGHT_NUM_THREADS": str(args.threads),
        "FREIGHT_MAX_MODEL_LEN": "512",
    }
    os.environ.update(env)
    settings = Settings()
    model = args.model or str(tiny_model(workdir / "tiny-model", settings))
    env |= {"FREIGHT_DEFAULT_MODEL": model, "FREIGHT_MODELS": json.dumps([model])}
    os.environ.update(env)
    settings = Settings()
    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        key = create_key(session, "load-bench").key
    engine.dispose()
    source = input_file(workdir / "input.parquet", args.rows)

    freight = str(Path(sys.executable).with_name("freight"))
    port = _free_port()
    logs = [open(workdir / name, "wb") for name in ("api.log", "worker.log")]  # noqa: SIM115
    api = subprocess.Popen(
        [freight, "api", "--port", str(port)], env=env, stdout=logs[0], stderr=subprocess.STDOUT
    )
    worker = subprocess.Popen([freight, "worker"], env=env, stdout=logs[1], stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        _wait_for_worker(settings)
        api_rss, worker_rss = PeakRSS(api.pid), PeakRSS(worker.pid)
        idle = {"api_mb": round(psutil.Process(api.pid).memory_info().rss / MB, 1)}
        idle["worker_mb"] = round(psutil.Process(worker.pid).memory_info().rss / MB, 1)
        with FreightClient(base, key, timeout=600) as client:
            started = time.monotonic()
            job = client.submit(source, max_tokens=args.max_tokens)
            submit_seconds = time.monotonic() - started
            done = client.wait(job["id"], poll_seconds=1.0, timeout=args.timeout)
            total_seconds = time.monotonic() - started
            results = client.download_results(job["id"], workdir / "results.parquet")
            metrics = client.metrics(job["id"])
        result_rows = pq.ParquetFile(results).metadata.num_rows
        return {
            "rows": args.rows,
            "max_tokens": args.max_tokens,
            "shard_size": args.shard_size,
            "input_mb": round(source.stat().st_size / MB, 2),
            "status": done["status"],
            "result_rows": result_rows,
            "rows_failed": metrics["rows_failed"],
            "submit_seconds": round(submit_seconds, 2),
            "total_seconds": round(total_seconds, 2),
            "rows_per_second": round(args.rows / total_seconds, 1),
            "rss_before_job_mb": idle,
            "api_peak_rss_mb": api_rss.peak_mb(),
            "worker_peak_rss_mb": worker_rss.peak_mb(),
        }
    finally:
        stop_all([api, worker], logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--model", help="model folder or alias (default: a tiny random Llama)")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, input, results)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="freight-load-"))
    try:
        report = run(args, workdir)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
