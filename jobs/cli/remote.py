"""CLI commands that talk to a Freight service over HTTP (FREIGHT_API_URL, FREIGHT_API_KEY)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.cli.params import params_dict_from_args
from jobs.cli.progress import RUNNING, JobProgress


class CLIError(Exception):
    pass


def add_commands(commands: argparse._SubParsersAction, add_job_param_args: Callable) -> None:
    def remote(name: str, help_text: str, handler: Callable) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("--api-url", help="default: FREIGHT_API_URL")
        parser.add_argument("--api-key", help="default: FREIGHT_API_KEY")
        parser.set_defaults(handler=handler)
        return parser

    submit = remote("submit", "submit a Parquet job to the service", cmd_submit)
    submit.add_argument(
        "file",
        nargs="+",
        help="the Parquet file to upload, or s3:// URIs the service reads in place (files, a folder/ or a glob)",
    )
    submit.add_argument("--wait", action="store_true", help="wait for the job, with a progress bar")
    submit.add_argument("-o", "--output", help="with --wait: download the results here")
    add_job_param_args(submit)

    quote = remote("quote", "price a job before submitting it: tokens, device-seconds, cost, ETA", cmd_quote)
    quote.add_argument("file", nargs="+", help="the Parquet file, or s3:// URIs, as for `submit`")
    add_job_param_args(quote)

    status = remote("status", "show a job", cmd_status)
    status.add_argument("job_id")

    results = remote("results", "download a job's results Parquet", cmd_results)
    results.add_argument("job_id")
    results.add_argument("-o", "--output", required=True)

    results_url = remote(
        "results-url", "print a pre-signed URL of a job's results (S3 store only)", cmd_results_url
    )
    results_url.add_argument("job_id")
    results_url.add_argument("--expires-in", type=int, help="seconds (default: the service's, an hour)")

    cancel = remote("cancel", "cancel a job", cmd_cancel)
    cancel.add_argument("job_id")

    metrics = remote("metrics", "show a job's metrics", cmd_metrics)
    metrics.add_argument("job_id")

    report = remote("report", "save a job's report: one HTML page with its cost table and plots", cmd_report)
    report.add_argument("job_id")
    report.add_argument("-o", "--output", required=True, help="HTML file to write")
    report.add_argument(
        "--local",
        action="store_true",
        help="a job run here (`freight run` / `summarize`), not on the service",
    )

    listing = remote("jobs", "list jobs, newest first", cmd_jobs)
    listing.add_argument("--status")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--after", help="job id to continue after")


def _client(args: argparse.Namespace) -> FreightClient:
    return FreightClient(base_url=args.api_url, api_key=args.api_key)


def _call(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except FreightAPIError as exc:
        raise CLIError(str(exc)) from exc
    except (httpx.TransportError, OSError) as exc:  # connection refused and friends
        raise CLIError(f"cannot reach the API: {exc}") from exc


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def cmd_submit(args: argparse.Namespace) -> int:
    params = params_dict_from_args(args)
    with _client(args) as client:
        job = _call(lambda: _submit(client, args.file, params))
        if not args.wait:
            _print_json(job)
            return 0
        print(f"submitted {job['id']}", file=sys.stderr)
        job = wait_with_progress(client, job["id"])
        _print_json(job)
        if args.output and job["status"] in ("completed", "cancelled"):
            _call(lambda: client.download_results(job["id"], Path(args.output)))
            print(f"results: {args.output}", file=sys.stderr)
        return 0 if job["status"] == "completed" else 1


def _submit(
    client: FreightClient, inputs: list[str], params: dict[str, Any], *, quote: bool = False
) -> dict[str, Any]:
    """An upload of one local file, or a submission by reference of URIs (the service decides which it
    may read: a file:// or http:// URI is sent too, and refused there with the reason); with `quote`,
    the quote of that submission."""
    uris = [item for item in inputs if "://" in item]
    if uris and len(uris) < len(inputs):
        raise CLIError("name either one local file to upload or only URIs (s3://...), not both")
    if uris:
        return (client.quote_by_reference if quote else client.submit_by_reference)(uris, params)
    if len(inputs) > 1:
        raise CLIError(f"{len(inputs)} local files: upload one file per job (or name s3:// URIs)")
    return (client.quote if quote else client.submit)(inputs[0], params)


def cmd_quote(args: argparse.Namespace) -> int:
    """The quote as JSON on stdout; a one-line summary on stderr (stdout stays JSON)."""
    params = params_dict_from_args(args)
    with _client(args) as client:
        quote = _call(lambda: _submit(client, args.file, params, quote=True))
    _print_json(quote)
    print(quote_line(quote), file=sys.stderr)
    return 0


def quote_line(quote: dict[str, Any]) -> str:
    tokens = "" if quote["prompt_tokens_exact"] else "~"
    line = (
        f"{quote['rows']} rows, {tokens}{quote['prompt_tokens']} prompt tokens, "
        f"{quote['output_tokens_expected']} output tokens expected"
    )
    if quote["device_seconds"] is None:
        return f"{line}; not priced: {quote['device_seconds_unknown_reason']}"
    return (
        f"{line}; {quote['device_seconds']:.1f} device-seconds, ${quote['cost_usd']:.6f}, "
        f"ETA {quote['eta_seconds']:.0f} s on {quote['queue']['workers']} worker(s)"
    )


def wait_with_progress(client: FreightClient, job_id: str) -> dict[str, Any]:
    from tqdm import tqdm

    # The ETA comes from the job's own rate (JobProgress), not from tqdm's, which would count queueing.
    bar = tqdm(
        total=0,
        unit="row",
        desc="rows",
        dynamic_ncols=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
    )

    def update(job: dict[str, Any]) -> None:
        metrics = client.metrics(job_id) if job["status"] in RUNNING else None
        progress = JobProgress.of(job, metrics)
        bar.total = progress.rows_total
        bar.n = progress.rows_done
        bar.set_postfix_str(progress.postfix(), refresh=False)
        bar.refresh()

    try:
        return _call(lambda: client.wait(job_id, on_update=update))
    finally:
        bar.close()


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = _call(lambda: client.get_job(args.job_id))
        metrics = _call(lambda: client.metrics(args.job_id)) if job["status"] in RUNNING else None
    _print_json(job)
    print(JobProgress.of(job, metrics).line(), file=sys.stderr)  # stdout stays JSON
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    if args.local:
        from jobs.cli.local import local_report_html
        from jobs.domain.errors import NotFound

        try:
            html = local_report_html(args.job_id)
        except NotFound as exc:
            raise CLIError(f"{exc} in the embedded database (FREIGHT_HOME)") from exc
    else:
        with _client(args) as client:
            html = _call(lambda: client.report_html(args.job_id))
    Path(args.output).write_text(html, encoding="utf-8")
    print(f"report: {args.output}", file=sys.stderr)
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _call(lambda: client.download_results(args.job_id, Path(args.output)))
    print(f"results: {args.output}", file=sys.stderr)
    return 0


def cmd_results_url(args: argparse.Namespace) -> int:
    """{url, expires_at, expires_in} as JSON on stdout."""
    with _client(args) as client:
        _print_json(_call(lambda: client.results_url(args.job_id, args.expires_in)))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(_call(lambda: client.cancel(args.job_id)))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(_call(lambda: client.metrics(args.job_id)))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = _call(lambda: client.list_jobs(status=args.status, limit=args.limit, after=args.after))
    for job in page["data"]:
        counts = job["request_counts"]
        done = counts["completed"] + counts["failed"]
        print(
            f"{job['id']}  {job['status']:<11}  {done}/{counts['total']} rows  {job['created_at']}  {job['model']}"
        )
    if page["has_more"]:
        print(f"more: freight jobs --after {page['last_id']}", file=sys.stderr)
    return 0
