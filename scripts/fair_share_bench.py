"""Fair share between tenants: tenant A submits a big job (many rows), then tenant B submits 100 rows to
the same model; prints B's time to done (from its submission) with fair share on and off
(FREIGHT_FAIR_SHARE), each through a fresh `freight api` and one `freight worker`.

    .venv/bin/python scripts/fair_share_bench.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/freight_fair \\
        --broker-url redis://127.0.0.1:6379/9 [--a-rows 20000] [--b-rows 100] [--shard-size 256] [--modes on]

The database is created if missing and migrated here. A tiny random-weight Llama (2 layers, hidden 64)
with SmolLM2's tokenizer, max_tokens 1: the point is the order shards run in, not the model. With fair
share on, A's job is cancelled once B's is done (its remaining time is not the point). Prints one JSON
object.
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

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))  # load_bench's helpers

from load_bench import _free_port, _wait_for_worker, stop_all, tiny_model, wait_ready  # noqa: E402

from jobs.cli.client import FreightAPIError, FreightClient  # noqa: E402
from jobs.domain.settings import Settings  # noqa: E402
from storage.db import make_engine, make_session_factory, upgrade  # noqa: E402
from storage.keys import create_key  # noqa: E402


def prompts(path: Path, rows: int, tag: str) -> Path:
    pq.write_table(pa.table({"prompt": [f"{tag} question {i}: what is {i % 97} plus 1?" for i in range(rows)]}), path)
    return path


def ensure_database(url: str) -> None:
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        found = connection.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": target.database})
        if not found:
            connection.execute(text(f'CREATE DATABASE "{target.database}"'))
    admin.dispose()


def one_run(args: argparse.Namespace, workdir: Path, model: str, fair_share: bool) -> dict:
    env = {
        **os.environ,
        "FREIGHT_DATABASE_URL": args.database_url,
        "FREIGHT_BROKER_URL": args.broker_url,
        "FREIGHT_DATA_DIR": str(workdir / "data"),
        "FREIGHT_QUEUE_PREFIX": f"freight-fair-{os.getpid()}-{int(fair_share)}",
        "FREIGHT_SHARD_SIZE": str(args.shard_size),
        "FREIGHT_MAX_UPLOAD_MB": "256",
        "FREIGHT_NUM_THREADS": str(args.threads),
        "FREIGHT_MAX_MODEL_LEN": "512",
        "FREIGHT_DEFAULT_MODEL": model,
        "FREIGHT_MODELS": json.dumps([model]),
        "FREIGHT_FAIR_SHARE": "true" if fair_share else "false",
    }
    os.environ.update(env)
    settings = Settings()
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        keys = {tenant: create_key(session, tenant).key for tenant in ("bench-a", "bench-b")}
    engine.dispose()
    a_file = prompts(workdir / "a.parquet", args.a_rows, "A")
    b_file = prompts(workdir / "b.parquet", args.b_rows, "B")
    freight = str(Path(sys.executable).with_name("freight"))
    port = _free_port()
    tag = "on" if fair_share else "off"
    logs = [open(workdir / f"{name}-{tag}.log", "wb") for name in ("api", "worker")]  # noqa: SIM115
    api = subprocess.Popen([freight, "api", "--port", str(port)], env=env, stdout=logs[0], stderr=subprocess.STDOUT)
    worker = subprocess.Popen([freight, "worker"], env=env, stdout=logs[1], stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        _wait_for_worker(settings)
        with FreightClient(base, keys["bench-a"], timeout=600) as a, FreightClient(base, keys["bench-b"]) as b:
            a_started = time.monotonic()
            a_job = a.submit(a_file, max_tokens=1)
            time.sleep(args.b_delay)  # A's job is running when B arrives
            b_started = time.monotonic()
            b_job = b.submit(b_file, max_tokens=1)
            b_done = b.wait(b_job["id"], poll_seconds=0.2, timeout=args.timeout)
            b_seconds = time.monotonic() - b_started
            a_at_b = a.get_job(a_job["id"])["request_counts"]["completed"]
            if fair_share and a.get_job(a_job["id"])["status"] in ("queued", "in_progress"):
                try:
                    a.cancel(a_job["id"])
                except FreightAPIError:  # it got to finalizing meanwhile
                    pass
            a_done = a.wait(a_job["id"], poll_seconds=0.5, timeout=args.timeout)
            a_seconds = time.monotonic() - a_started
        return {
            "fair_share": fair_share,
            "b_status": b_done["status"],
            "b_seconds_to_done": round(b_seconds, 2),
            "a_rows_done_when_b_done": a_at_b,
            "a_status": a_done["status"],
            "a_seconds": round(a_seconds, 2),
        }
    finally:
        stop_all([api, worker], logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-rows", type=int, default=20_000)
    parser.add_argument("--b-rows", type=int, default=100)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--b-delay", type=float, default=2.0, help="seconds between A's and B's submissions")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, inputs)")
    parser.add_argument(
        "--modes", default="on,off", choices=["on,off", "on", "off"], help="fair share on, off or both"
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="freight-fair-"))
    try:
        ensure_database(args.database_url)
        os.environ["FREIGHT_DATABASE_URL"] = args.database_url
        upgrade(args.database_url)
        model = str(tiny_model(workdir / "tiny-model", Settings()))
        modes = {"on": True, "off": False}
        runs = [one_run(args, workdir, model, modes[mode]) for mode in args.modes.split(",")]
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "a_rows": args.a_rows,
        "b_rows": args.b_rows,
        "shard_size": args.shard_size,
        "max_tokens": 1,
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
