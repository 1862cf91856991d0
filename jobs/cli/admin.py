"""Commands that run or administer the service: db, keys, api, worker, flower, models, bench."""

from __future__ import annotations

import argparse
import sys

from jobs.domain.settings import Settings


def add_commands(commands: argparse._SubParsersAction) -> None:
    db = commands.add_parser("db", help="database schema (Alembic)")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_commands.add_parser("upgrade", help="migrate FREIGHT_DATABASE_URL to the newest schema")
    upgrade.add_argument("--revision", default="head")
    upgrade.set_defaults(handler=cmd_db_upgrade)
    db_commands.add_parser("current", help="show the schema revision").set_defaults(handler=cmd_db_current)

    keys = commands.add_parser("keys", help="API keys (each bound to a tenant)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = key_commands.add_parser("create", help="create a key; it is printed once, only a hash is stored")
    create.add_argument("--tenant", required=True)
    create.set_defaults(handler=cmd_keys_create)
    revoke = key_commands.add_parser("revoke", help="revoke a key (by key id or the key itself)")
    revoke.add_argument("key")
    revoke.set_defaults(handler=cmd_keys_revoke)
    listing = key_commands.add_parser("list", help="list key ids and tenants")
    listing.add_argument("--tenant")
    listing.set_defaults(handler=cmd_keys_list)

    api = commands.add_parser("api", help="run the HTTP API (uvicorn)")
    api.add_argument("--host", help="default: FREIGHT_API_HOST")
    api.add_argument("--port", type=int, help="default: FREIGHT_API_PORT")
    api.add_argument("--workers", type=int, default=1)
    api.set_defaults(handler=cmd_api)

    worker = commands.add_parser("worker", help="run a Celery worker for one model's queue")
    worker.add_argument("--model", help="default: FREIGHT_DEFAULT_MODEL")
    worker.add_argument("--pool", choices=["threads", "solo"], default="threads")
    worker.add_argument("--concurrency", type=int, default=1, help="shards at once (they share one engine)")
    worker.add_argument("--hostname", help="Celery node name (default: freight-<pid>@<host>)")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument("--no-preload", action="store_true", help="load the model on the first shard")
    worker.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (default: FREIGHT_WORKER_METRICS_PORT)",
    )
    worker.set_defaults(handler=cmd_worker)

    flower = commands.add_parser("flower", help="run Flower against the broker the workers use")
    flower.add_argument("--port", type=int, help="default: FREIGHT_FLOWER_PORT")
    flower.add_argument("--address", default="127.0.0.1")
    flower.set_defaults(handler=cmd_flower)

    models = commands.add_parser("models", help="model files")
    model_commands = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    pull = model_commands.add_parser("pull", help="fetch and convert a model into the cache")
    pull.add_argument("alias")
    pull.add_argument("--cache-dir", help="default: FREIGHT_HOME/models")
    pull.set_defaults(handler=cmd_models_pull)
    check = model_commands.add_parser(
        "check", help="whether the engine runs a model (alias, HF folder or .gguf): its family, shape, parameters"
    )
    check.add_argument("model")
    check.add_argument("--cache-dir", help="default: FREIGHT_HOME/models")
    check.set_defaults(handler=cmd_models_check)
    model_commands.add_parser(
        "list",
        help="the models workers recorded (FREIGHT_DATABASE_URL): family, context, or why the engine refuses one",
    ).set_defaults(handler=cmd_models_list)

    doctor = commands.add_parser(
        "doctor", help="this machine (CPU tier, extensions, torch, CUDA) and the path the engine takes per op"
    )
    doctor.add_argument("--model", help="default: FREIGHT_DEFAULT_MODEL")
    doctor.add_argument("--dtype", help="default: FREIGHT_DTYPE (auto)")
    doctor.add_argument("--quantization", help="default: FREIGHT_QUANTIZATION (auto)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.set_defaults(handler=cmd_doctor)

    bench = commands.add_parser(
        "bench", help="engine benchmark (arguments go to the benchmark)", add_help=False
    )
    bench.set_defaults(handler=None)


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from jobs.domain.engine_settings import engine_options_of
    from worker.engine.config import EngineConfig
    from worker.engine.doctor import doctor_report, format_report

    settings = Settings()
    # every engine option as a worker loads with it (derived from the one declaration of the options), then
    # what the flags ask
    options = engine_options_of(settings) | {"model": args.model or settings.default_model,
                                             "cache_dir": str(settings.models_dir)}  # fmt: skip
    if args.dtype:
        options["dtype"] = args.dtype
    if args.quantization:
        options["quantization"] = None if args.quantization.lower() in ("none", "off") else args.quantization
    report = doctor_report(EngineConfig(**options))
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _upgrade_if_embedded(settings: Settings) -> None:
    """The embedded SQLite database migrates itself; Postgres is migrated by `freight db upgrade`."""
    from storage.db import upgrade

    if settings.resolved_database_url.startswith("sqlite"):
        upgrade(settings.resolved_database_url)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from storage.db import upgrade

    url = Settings().resolved_database_url
    upgrade(url, args.revision)
    print(f"database at {_redacted(url)} is at revision {args.revision}")
    return 0


def cmd_db_current(_args: argparse.Namespace) -> int:
    from storage.db import current_revision

    print(current_revision(Settings().resolved_database_url) or "empty")
    return 0


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _sessions(settings: Settings):
    from storage.db import make_engine, make_session_factory

    _upgrade_if_embedded(settings)
    return make_session_factory(make_engine(settings.resolved_database_url))


def cmd_keys_create(args: argparse.Namespace) -> int:
    from storage.keys import create_key

    with _sessions(Settings())() as session:
        new_key = create_key(session, args.tenant)
    print(new_key.key)
    print(
        f"key id {new_key.key_id} for tenant {new_key.tenant!r}; the key is shown only now", file=sys.stderr
    )
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from storage.keys import revoke_key

    with _sessions(Settings())() as session:
        revoked = revoke_key(session, args.key)
    print("revoked" if revoked else "no such active key", file=sys.stderr)
    return 0 if revoked else 1


def cmd_keys_list(args: argparse.Namespace) -> int:
    from storage.keys import list_keys

    with _sessions(Settings())() as session:
        for key in list_keys(session, args.tenant):
            state = f"revoked {key.revoked_at:%Y-%m-%d}" if key.revoked_at else "active"
            print(f"{key.key_id}  {key.tenant}  {key.created_at:%Y-%m-%d %H:%M}  {state}")
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from jobs.api.server import http_protocol

    settings = Settings()
    uvicorn.run(
        "jobs.api.app:create_app",
        factory=True,
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        workers=args.workers,
        log_level="info",
        http=http_protocol(),  # the protocol's own 400s in Freight's error shape (jobs/api/server.py)
    )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import logging

    from worker.celery_app import run_worker

    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    if args.metrics_port is not None:
        settings = settings.model_copy(update={"worker_metrics_port": args.metrics_port})
    run_worker(
        settings,
        args.model or settings.default_model,
        pool=args.pool,
        concurrency=args.concurrency,
        loglevel=args.loglevel,
        hostname=args.hostname,
        preload=not args.no_preload,
    )
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    from celery.bin.celery import main as celery_main

    settings = Settings()
    if not settings.broker_url:
        print("freight: FREIGHT_BROKER_URL is not set", file=sys.stderr)
        return 2
    # The same broker (the same Redis lists) the API sends shards to and the workers consume.
    sys.argv = [
        "celery",
        f"--broker={settings.broker_url}",
        "flower",
        f"--port={args.port or settings.flower_port}",
        f"--address={args.address}",
    ]
    return celery_main() or 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from worker.commands import models_pull

    print(models_pull(args.alias, args.cache_dir))
    return 0


def cmd_models_check(args: argparse.Namespace) -> int:
    from worker.commands import models_check

    try:
        lines = models_check(args.model, args.cache_dir)
    except ValueError as exc:
        print(f"freight models check: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def cmd_models_list(_args: argparse.Namespace) -> int:
    from jobs.domain.served_models import model_context, unservable
    from storage.model_store import list_models

    settings = Settings()
    cap = settings.max_model_len
    with _sessions(settings)() as session:
        records = list_models(session)
    for record in records:
        if record.loadable:
            context = model_context(record.context_len, cap)
            state = f"{record.model_type}, context {context:,} tokens (its own {record.context_len:,})"
        else:
            state = f"{record.model_type or 'no model_type'}: {unservable(record.name, record.error or '')}"
        when = f"{record.recorded_at:%Y-%m-%d %H:%M}"
        print(f"{record.name}  {state}  [recorded {when} by {record.recorded_by}]")
    recorded = {record.name for record in records}
    for name in settings.accepted_models():
        if name not in recorded:
            context = model_context(None, cap)
            print(f"{name}  not recorded yet: no worker has loaded it (context {context:,} tokens)")
    return 0


def run_bench(argv: list[str]) -> int:
    from worker.commands import bench

    return bench(argv)
