"""`freight summarize`: summarize the documents of a Parquet file in this process (embedded, like
`freight run`), with no prompt to write. The service takes the same job as `task: "summarize"`."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from jobs.domain.errors import InputError
from jobs.domain.schemas import JobParams

SUMMARIZE_FLAGS = (
    "model",
    "column",
    "style",
    "template",
    "max_tokens",
    "long_documents",
    "id_column",
    "temperature",
    "seed",
)


def add_commands(commands: argparse._SubParsersAction) -> None:
    summarize = commands.add_parser(
        "summarize", help="summarize the documents of a Parquet file here (embedded, no services)"
    )
    summarize.add_argument("input", help="input Parquet file with one document per row")
    summarize.add_argument("-o", "--output", required=True, help="results Parquet file (adds `summary`)")
    summarize.add_argument("--column", help="the document column (default: text)")
    how = summarize.add_mutually_exclusive_group()
    how.add_argument("--style", help='how the summary reads (default: "one paragraph")')
    how.add_argument(
        "--template", help='your own instruction with a {text} placeholder, e.g. "Summarize:\\n\\n{text}"'
    )
    summarize.add_argument("--max-tokens", type=int, help="summary length limit in tokens (default: 256)")
    summarize.add_argument(
        "--long-documents",
        choices=["map_reduce", "truncate"],
        help="documents longer than the context: summarize windows then combine (default), or keep the start",
    )
    summarize.add_argument(
        "--id-column", help="input column kept in the output (default: custom_id, id, doc_id)"
    )
    summarize.add_argument("--model", help="model alias or folder (default: FREIGHT_DEFAULT_MODEL)")
    summarize.add_argument("--temperature", type=float)
    summarize.add_argument("--seed", type=int)
    summarize.add_argument("--metrics-json", help="also write the job's metrics here")
    summarize.add_argument("--no-progress", action="store_true")
    summarize.set_defaults(handler=cmd_summarize)


def summarize_params(args: argparse.Namespace) -> JobParams:
    payload: dict[str, Any] = {"task": "summarize"}
    for name in SUMMARIZE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            payload[name] = value
    if "template" in payload:
        # A shell argument cannot easily hold a newline: accept \n and \t escapes.
        payload["template"] = payload["template"].replace("\\n", "\n").replace("\\t", "\t")
    try:
        return JobParams.model_validate(payload)
    except ValidationError as exc:
        raise InputError(f"invalid summarize parameters: {exc}") from exc


def cmd_summarize(args: argparse.Namespace) -> int:
    from jobs.cli.local import run_locally

    return run_locally(args, summarize_params(args))
