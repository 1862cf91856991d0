"""`freight run` (embedded), `freight sample-docs` and `freight report --local`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jobs.cli.params import params_from_args
from jobs.domain.sample_docs import SUMMARIZE_TEMPLATE, write_sample_docs
from jobs.domain.schemas import JobParams
from jobs.domain.settings import Settings


def cmd_sample_docs(args: argparse.Namespace) -> int:
    path = write_sample_docs(Path(args.output), args.rows)
    print(f"wrote {path} (columns custom_id, title, text); summarize it with:")
    print(f"  freight summarize {path} --column text -o summaries.parquet --max-tokens 128")
    print("or prompt the model yourself:")
    print(
        f'  freight run {path} -o summaries.parquet --max-tokens 64 --template "{_escaped(SUMMARIZE_TEMPLATE)}"'
    )
    return 0


def _escaped(template: str) -> str:
    return template.replace("\n", "\\n")


def cmd_run(args: argparse.Namespace) -> int:
    return run_locally(args, params_from_args(args))


def run_locally(args: argparse.Namespace, params: JobParams) -> int:
    """Run a job in this process with a progress bar (`freight run`, `freight summarize`); args
    holds input, output, metrics_json and no_progress."""
    from tqdm import tqdm

    from worker.embedded import RunProgress, run_embedded

    source = Path(args.input)
    if not source.is_file():
        print(f"freight: no such file: {source}", file=sys.stderr)
        return 2
    bars: list[tqdm] = []  # made on the first update, once the model is loaded

    def on_progress(update: RunProgress) -> None:
        if not bars:
            bars.append(tqdm(total=update.rows_total, unit="row", desc="rows", disable=args.no_progress))
        bar = bars[0]
        bar.n = update.rows_done
        rate = update.tokens_done / update.elapsed_s if update.elapsed_s else 0.0
        bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        bar.refresh()

    def on_status(message: str) -> None:
        print(message, file=sys.stderr)

    try:
        result = run_embedded(
            source, Path(args.output), params, Settings(), on_progress=on_progress, on_status=on_status
        )
    finally:
        for bar in bars:
            bar.close()
    if args.metrics_json:
        Path(args.metrics_json).write_text(json.dumps(result.metrics, indent=2))
    print(cost_summary(result.job_id, result.status, result.metrics))
    if result.status != "completed":
        print(f"freight: job ended {result.status}", file=sys.stderr)
        return 1
    print(f"results: {result.output_path}")
    return 0


def cost_summary(job_id: str, status: str, m: dict[str, Any]) -> str:
    total = m["prompt_tokens"] + m["output_tokens"]
    # rows reused from the result cache (docs/result-cache.md), when there are any
    reused = (
        [f"result cache: {m['cached_rows']} rows reused, {m['saved_device_seconds']:.1f} device-seconds saved"]
        if m.get("cached_rows")
        else []
    )
    return "\n".join(
        [
            f"job {job_id} {status}: {m['rows']} rows ({m['rows_completed']} ok, {m['rows_failed']} errors) "
            f"in {m['wall_seconds']:.1f} s over {m['shards']} shard(s)",
            f"tokens: {m['prompt_tokens']:,} prompt + {m['output_tokens']:,} output = {total:,} "
            f"({m['tokens_per_second']:.1f} tokens/s, {m['output_tokens_per_second']:.1f} output tokens/s)",
            f"cost: {m['device_seconds']:.1f} device-seconds at ${m['device_hour_usd']:.2f}/h = ${m['cost_usd']:.6f} "
            f"(${m['cost_per_million_tokens_usd']:.4f} per million tokens)",
            f"engine: mean batch {m['mean_batch_size']:.1f}, peak KV use {m['peak_kv_utilization']:.1%}, "
            f"{m['preemptions']} preemptions, {m['padding_tokens']:,} padding tokens, "
            f"{m['computed_tokens']:,} computed tokens, {m['cached_prompt_tokens']:,} prompt tokens from the prefix cache, "
            f"{m['accepted_draft_tokens']:,} of {m['draft_tokens']:,} draft tokens accepted",
            *reused,
        ]
    )


def local_report_html(job_id: str, settings: Settings | None = None) -> str:
    """The report of a job run here (`freight run` / `freight summarize`), from the embedded database
    (`freight report --local`)."""
    from jobs.domain.report import job_report_html
    from jobs.domain.service import LOCAL_TENANT, JobService
    from storage.blobs import BlobStore
    from storage.db import make_engine, make_session_factory

    settings = settings or Settings()
    engine = make_engine(settings.embedded_database_url)
    try:
        blobs = BlobStore(settings.resolved_data_dir)
        service = JobService(
            settings, make_session_factory(engine), blobs, dispatcher=None, allow_any_model=True
        )
        return job_report_html(service, LOCAL_TENANT, job_id)
    finally:
        engine.dispose()
