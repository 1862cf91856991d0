"""`freight`: run a job here (`run`), talk to a Freight service (`submit`, `status`, ...), or run one
(`db upgrade`, `keys`, `api`, `worker`, `flower`). Engine commands import the engine lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jobs.cli import admin, local, remote, summarize
from jobs.cli.params import add_job_param_args
from jobs.domain.errors import InputError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freight", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a job in this process (embedded SQLite, no services)")
    run.add_argument("input", help="input Parquet file")
    run.add_argument("-o", "--output", required=True, help="results Parquet file to write")
    run.add_argument("--metrics-json", help="also write the job's metrics here")
    run.add_argument("--no-progress", action="store_true")
    add_job_param_args(run)
    run.set_defaults(handler=local.cmd_run)

    sample = commands.add_parser("sample-docs", help="write the sample documents for a summarization demo")
    sample.add_argument("-o", "--output", required=True)
    sample.add_argument("--rows", type=int, help="number of rows (documents repeat past the shipped set)")
    sample.set_defaults(handler=local.cmd_sample_docs)

    summarize.add_commands(commands)
    remote.add_commands(commands, add_job_param_args)
    admin.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return admin.run_bench(argv[1:])  # every remaining argument belongs to the benchmark
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except InputError as exc:
        print(f"freight: {exc.message}", file=sys.stderr)
        return 2
    except remote.CLIError as exc:
        print(f"freight: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
