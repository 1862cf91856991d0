"""The job report: one self-contained HTML page (inline CSS and SVG, no scripts, nothing fetched) with
the job's parameters and status, its cost table and plots of what the engine did: prompt and output
lengths, tokens/s, running batch size and KV-cache use over time (from the shards' bounded time
series), and the padding continuous batching avoided compared with static padded batches."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from html import escape
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from jobs.domain.service import JobService
from jobs.domain.svg_plots import bar_chart_svg, histogram_svg, line_chart_svg
from storage import job_store
from storage.models import Job, as_utc
from storage.result_store import completed_token_lengths
from storage.shard_store import shards_of

MAX_PLOT_POINTS = 600  # over all shards, per plot
LENGTHS_BATCH_ROWS = 50_000  # result rows fetched at a time for the histograms


@dataclass
class TimelinePoint:
    t: float  # seconds since the job started
    tokens_per_s: float
    running: float
    kv_use: float  # fraction of the shard's engine KV blocks in use


@dataclass
class ReportData:
    job: dict[str, Any]  # the API's job object
    metrics: dict[str, Any]
    events: list[tuple[str, datetime]]
    prompt_tokens: np.ndarray  # [completed rows] in row order
    output_tokens: np.ndarray  # [completed rows]
    timeline: list[list[TimelinePoint]] = field(default_factory=list)  # one list per shard
    quote: dict[str, Any] | None = None  # the job's quote at submission (jobs/domain/quote.py JobQuote)


def collect(session: Session, job: Job, job_object: dict[str, Any], metrics: dict[str, Any]) -> ReportData:
    chunks = [
        np.array(chunk, dtype=np.int32).reshape(-1, 2)
        for chunk in completed_token_lengths(session, job_id=job.id, batch_rows=LENGTHS_BATCH_ROWS)
    ]
    lengths = np.concatenate(chunks) if chunks else np.zeros((0, 2), dtype=np.int32)  # [rows, 2]
    return ReportData(
        job=job_object,
        metrics=metrics,
        events=[(event.status, as_utc(event.at)) for event in job_store.events(session, job.id)],
        prompt_tokens=lengths[:, 0],
        output_tokens=lengths[:, 1],
        timeline=_timeline(session, job),
        quote=job.quote,
    )


def _timeline(session: Session, job: Job) -> list[list[TimelinePoint]]:
    """Each shard's samples on the job's clock. A sample's `t` is on its engine's own clock, so each
    shard is anchored at its finish time: its last sample is from just before it finished."""
    start = as_utc(job.started_at)
    if start is None:
        return []
    shards = []
    for shard in shards_of(session, job.id):
        stats = shard.stats or {}
        points = stats.get("timeline") or []
        finished = as_utc(shard.finished_at)
        if not points or finished is None:
            continue
        blocks = float(stats.get("engine", {}).get("num_kv_blocks") or 0)
        end = (finished - start).total_seconds()
        last_t = points[-1]["t"]
        shards.append(
            [
                TimelinePoint(
                    t=max(0.0, end - (last_t - point["t"])),
                    tokens_per_s=float(point["tokens_per_s"]),
                    running=float(point["running"]),
                    kv_use=float(point["kv_blocks_used"]) / blocks if blocks else 0.0,
                )
                for point in points
            ]
        )
    total = sum(len(points) for points in shards)
    if total > MAX_PLOT_POINTS:
        stride = -(-total // MAX_PLOT_POINTS)
        shards = [points[::stride] for points in shards]
    return shards


def static_batch_tokens(prompt: np.ndarray, output: np.ndarray, batch_size: int) -> int:
    """Tokens a static batcher computes: rows in batches of `batch_size`, each row padded to the
    batch's longest prompt plus its longest output."""
    total = 0
    for start in range(0, len(prompt), batch_size):
        rows = slice(start, start + batch_size)
        count = len(prompt[rows])
        total += count * int(prompt[rows].max() + output[rows].max())
    return total


def padding_bars(data: ReportData) -> list[tuple[str, float]]:
    prompt, output = data.prompt_tokens, data.output_tokens
    if len(prompt) == 0:
        return []
    batch = max(1, round(data.metrics.get("mean_batch_size") or 1))
    by_length = np.argsort(prompt + output, kind="stable")
    return [
        ("computed (continuous)", float(data.metrics.get("computed_tokens") or int((prompt + output).sum()))),
        (f"static batches of {batch}, input order", float(static_batch_tokens(prompt, output, batch))),
        (
            f"static batches of {batch}, sorted",
            float(static_batch_tokens(prompt[by_length], output[by_length], batch)),
        ),
    ]


COST_ROWS = (
    ("rows", "rows", ""),
    ("rows_completed", "completed", ""),
    ("rows_failed", "errors", ""),
    ("rows_cancelled", "cancelled", ""),
    ("prompt_tokens", "prompt tokens", ""),
    ("output_tokens", "output tokens", ""),
    ("computed_tokens", "computed tokens", ""),
    ("cached_prompt_tokens", "prompt tokens from the prefix cache", ""),
    ("draft_tokens", "speculative draft tokens", ""),
    ("accepted_draft_tokens", "draft tokens accepted", ""),
    ("padding_tokens", "padding tokens", ""),
    ("documents_split", "documents split into windows", ""),
    ("windows", "summary windows", ""),
    ("reduce_requests", "summary reduce requests", ""),
    ("cached_rows", "rows reused from the result cache", ""),
    ("saved_prompt_tokens", "prompt tokens the reused rows saved", ""),
    ("saved_output_tokens", "output tokens the reused rows saved", ""),
    ("saved_device_seconds", "device time the reused rows saved", "s"),
    ("wall_seconds", "wall time", "s"),
    ("queue_seconds", "time queued", "s"),
    ("device_seconds", "device time", "s"),
    ("tokens_per_second", "tokens/s", ""),
    ("output_tokens_per_second", "output tokens/s", ""),
    ("mean_batch_size", "mean running batch", ""),
    ("peak_kv_utilization", "peak KV-cache use", "%"),
    ("preemptions", "preemptions", ""),
    ("shards", "shards", ""),
    ("device_hour_usd", "device price", "$/h"),
    ("cost_usd", "cost", "$"),
    ("cost_per_million_tokens_usd", "cost per million tokens", "$"),
)


SUMMARY_KEYS = ("documents_split", "windows", "reduce_requests")  # shown for map-reduce summaries only


def _cost_table(metrics: dict[str, Any]) -> str:
    rows = []
    for key, label, unit in COST_ROWS:
        if key not in metrics or (key in SUMMARY_KEYS and not metrics[key]):
            continue
        value = metrics[key]
        if unit == "%":
            text = f"{value:.1%}"
        elif unit == "$":
            text = f"${value:,.6f}"
        elif isinstance(value, float):
            text = f"{value:,.2f} {unit}".strip()
        else:
            text = f"{value:,} {unit}".strip()
        rows.append(f'<tr><th scope="row">{escape(label)}</th><td data-key="{key}">{escape(text)}</td></tr>')
    return '<table class="cost">' + "".join(rows) + "</table>"


def _plots(data: ReportData) -> list[str]:
    timeline = data.timeline

    def series(attribute: str, scale: float = 1.0) -> list[list[tuple[float, float]]]:
        return [[(point.t, getattr(point, attribute) * scale) for point in points] for points in timeline]

    return [
        histogram_svg(data.prompt_tokens, "Prompt length", "prompt tokens per row"),
        histogram_svg(data.output_tokens, "Output length", "output tokens per row"),
        line_chart_svg(series("tokens_per_s"), "Throughput over time", "seconds since start", "tokens/s"),
        line_chart_svg(series("running"), "Running batch size over time", "seconds since start", "sequences"),
        line_chart_svg(
            series("kv_use", 100.0),
            "KV-cache use over time",
            "seconds since start",
            "% of blocks",
            y_max=100.0,
        ),
        bar_chart_svg(padding_bars(data), "Tokens computed vs static padded batches", "tokens"),
    ]


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#111;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:24px 0 8px}
.status{display:inline-block;padding:2px 10px;border-radius:10px;background:#e5e7eb;font-weight:600}
.status.completed{background:#dcfce7;color:#166534} .status.failed{background:#fee2e2;color:#991b1b}
.status.cancelled{background:#fef3c7;color:#92400e}
table{border-collapse:collapse;font-size:14px} th,td{padding:3px 12px;border-bottom:1px solid #e5e7eb;text-align:left}
td{font-variant-numeric:tabular-nums}
pre{background:#f3f4f6;padding:10px;font-size:13px;overflow:auto;max-width:1100px}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:16px}
svg.chart{background:#fafafa;border:1px solid #e5e7eb;font-size:11px}
svg .title{font-size:14px;font-weight:600} svg .grid{stroke:#e5e7eb} svg .axis{stroke:#6b7280}
svg .bar{fill:#2563eb} svg.bars .bar{fill-opacity:.85} svg .series{stroke-width:1.5}
.meta{color:#4b5563;font-size:14px}
"""


def render(data: ReportData) -> str:
    job = data.job
    counts = job["request_counts"]
    status = escape(str(job["status"]))
    events = "".join(
        f"<tr><td>{escape(str(status_))}</td><td>{at:%Y-%m-%d %H:%M:%S} UTC</td></tr>"
        for status_, at in data.events
    )
    error = f'<p class="error"><b>Error:</b> {escape(job["error"])}</p>' if job.get("error") else ""
    params = escape(json.dumps(job["params"], indent=2, default=str))
    metadata = escape(json.dumps(job.get("metadata") or {}, indent=2))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Freight job {escape(job["id"])}</title>
<style>{STYLE}</style></head>
<body>
<header id="job-header">
<h1>Freight job <code>{escape(job["id"])}</code> <span class="status {status}" id="job-status">{status}</span></h1>
<p class="meta">model {escape(str(job["model"]))} · {counts["total"]} rows: {counts["completed"]} completed,
{counts["failed"]} errors · created {escape(str(job["created_at"]))}{_schedule(job)}</p>
{error}
</header>
<section id="cost"><h2>Cost</h2>{_cost_table(data.metrics)}</section>
{quote_section(data)}
<section id="plots"><h2>What the engine did</h2><div class="plots">{"".join(_plots(data))}</div></section>
<section id="params"><h2>Parameters</h2><pre>{params}</pre><h2>Metadata</h2><pre>{metadata}</pre></section>
<section id="events"><h2>Status history</h2><table>{events}</table></section>
</body></html>
"""


def quote_section(data: ReportData) -> str:
    """The job's quote at submission beside what the job took (empty for a job stored without one)."""
    quote = data.quote
    if not quote:
        return ""
    metrics, job = data.metrics, data.job
    took = None
    if job.get("finished_at") and job.get("created_at"):
        took = (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["created_at"])).total_seconds()
    prompt_label = "prompt tokens" if quote.get("prompt_tokens_exact") else "prompt tokens (from characters)"
    rows = [
        ("prompt_tokens", prompt_label, quote.get("prompt_tokens"), metrics.get("prompt_tokens")),
        ("output_tokens", "output tokens", quote.get("output_tokens_expected"), metrics.get("output_tokens")),
        ("device_seconds", "device time (s)", quote.get("device_seconds"), metrics.get("device_seconds")),
        ("cost_usd", "cost ($)", quote.get("cost_usd"), metrics.get("cost_usd")),
        ("eta_seconds", "submission to done (s)", quote.get("eta_seconds"), took),
    ]
    body = "".join(
        f'<tr><th scope="row">{escape(label)}</th><td data-key="quoted_{key}">{_number(quoted)}</td>'
        f'<td data-key="actual_{key}">{_number(actual)}</td></tr>'
        for key, label, quoted, actual in rows
    )
    why = quote.get("device_seconds_unknown_reason")
    note = f'<p class="meta">Not priced at submission: {escape(why)}</p>' if why else ""
    return (
        '<section id="quote"><h2>Quote at submission</h2><table class="quote">'
        f"<tr><th></th><th>quoted</th><th>actual</th></tr>{body}</table>{note}</section>"
    )


def _number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return escape(f"{value:,}")


def _schedule(job: dict[str, Any]) -> str:
    """The job's priority and deadline for the header line (docs/scheduling.md)."""
    text = f" · priority {escape(str(job.get('priority', 'normal')))}"
    if job.get("deadline"):
        text += f" · due {escape(str(job['deadline']))}"
    if job.get("expired_at"):
        text += f" · expired {escape(str(job['expired_at']))}"
    if job.get("deadline_warning"):
        text += f'<br><span class="error">{escape(job["deadline_warning"])}</span>'
    return text


def job_report_html(service: JobService, tenant: str, job_id: str) -> str:
    """The report of one of the tenant's jobs (NotFound for anyone else's)."""
    job_object = service.get(tenant, job_id).model_dump(mode="json")
    metrics = service.metrics(tenant, job_id)
    with service.sessions() as session:
        job = job_store.get_job(session, job_id, tenant=tenant)
        return render(collect(session, job, job_object, metrics))
