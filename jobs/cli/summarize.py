"""`freight summarize`: summarize the documents of a Parquet file in this process (embedded, like
`freight run`), with no prompt to write. The service takes the same job as `task: "summarize"`."""

from __future__ import annotations

import argparse

from jobs.cli.params import add_field_flag, add_field_flags, flag_values
from jobs.domain.schemas import JobParams, job_params


def add_commands(commands: argparse._SubParsersAction) -> None:
    summarize = commands.add_parser(
        "summarize", help="summarize the documents of a Parquet file here (embedded, no services)"
    )
    summarize.add_argument("input", help="input Parquet file with one document per row")
    summarize.add_argument("-o", "--output", required=True, help="results Parquet file (adds `summary`)")
    add_field_flag(summarize, "column")
    how = summarize.add_mutually_exclusive_group()
    add_field_flag(how, "style")
    add_field_flag(
        how, "template", help='your own instruction with a {text} placeholder, e.g. "Summarize:\\n\\n{text}"'
    )
    add_field_flags(
        summarize,
        ("max_tokens", "long_documents", "id_column", "model", "temperature", "seed"),
        help={"max_tokens": "summary length limit in tokens"},
    )
    summarize.add_argument("--metrics-json", help="also write the job's metrics here")
    summarize.add_argument("--no-progress", action="store_true")
    summarize.set_defaults(handler=cmd_summarize)


def summarize_params(args: argparse.Namespace) -> JobParams:
    return job_params({"task": "summarize", **flag_values(args)})


def cmd_summarize(args: argparse.Namespace) -> int:
    from jobs.cli.local import run_locally

    return run_locally(args, summarize_params(args))
