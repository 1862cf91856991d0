"""Seeing a job while it runs and after: shard progress in Flower (read back from its HTTP API, and its
task page rendered in headless Chromium), `freight status` with a progress bar, the job report, and
Prometheus metrics on the API and on the worker. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.cli.client import FreightClient
from jobs.cli.main import main as freight_main
from jobs.cli.progress import JobProgress
from jobs.domain.broker import TASK_RUN_SHARD
from tests.jobs.test_summarize import check_report_in_chromium
from tests.service.browser import dump_dom, png_colors, screenshot
from tests.service.fixtures import Process, ServiceEnv, free_port, wait_until
from tests.service.test_workers import ProgressEvents

pytestmark = pytest.mark.slow
ROWS = 16  # four shards of four rows


@pytest.fixture(scope="module")
def flower_url(service_env: ServiceEnv, log_dir: Path) -> Iterator[str]:
    port = free_port()
    env = service_env.subprocess_env(FLOWER_UNAUTHENTICATED_API="true")
    process = Process(["flower", "--port", str(port)], env, log_dir / "flower-observe.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/healthcheck", timeout=2).status_code == 200, 60, "flower", process)
    yield url
    process.stop()


@pytest.fixture(scope="module")
def watched_job(
    flower_url: str, worker: Process, api_url: str, api_keys: dict[str, str], service_env: ServiceEnv
) -> Iterator[dict]:
    with FreightClient(api_url, api_keys["acme"]) as client:
        yield watch(client, flower_url, api_url, api_keys["acme"], worker, service_env)


def watch(
    client: FreightClient, flower_url: str, api_url: str, key: str, worker: Process, service: ServiceEnv
) -> dict:
    """Runs a job and freezes the worker (SIGSTOP) in the middle of a shard, right after that shard
    sent a progress event: while it is frozen, Flower must show the task in PROGRESS and `freight
    status` must show rows done, tokens/s and an ETA. Both are recorded, then the worker goes on."""
    listener = ProgressEvents(service)
    # Each shard's rows stop after 60, 160, 320 and 480 tokens: after its first two rows are stored
    # (a progress event) the shard still decodes for a second or so.
    table = pa.table(
        {
            "prompt": [f"Write a long story about the number {i}." for i in range(ROWS)],
            "max_tokens": [(60, 160, 320, 480)[i % 4] for i in range(ROWS)],
        }
    )
    job = client.submit(table)
    frozen: dict = {}
    handled = 0
    try:
        deadline = time.monotonic() + 300
        while not frozen and time.monotonic() < deadline:
            events = [e for e in listener.events[handled:] if e.get("job_id") == job["id"]]
            handled = len(listener.events)
            # A later shard still running: earlier shards' rows are stored, so the job has a rate.
            if not any(e["shard"] > 0 and 2 <= e["rows_done"] < e["rows_total"] for e in events):
                time.sleep(0.02)
                continue
            os.kill(worker.popen.pid, signal.SIGSTOP)
            try:
                wait_until(
                    lambda: bool(in_progress(flower_url, job["id"])), 10, "a task in PROGRESS in flower"
                )
            except AssertionError:
                os.kill(worker.popen.pid, signal.SIGCONT)  # the shard ended first; try the next one
                continue
            task_id, task = next(iter(in_progress(flower_url, job["id"]).items()))
            page = f"{flower_url}/task/{task_id}"
            frozen = {
                "task": task,
                "status_line": freight_status(api_url, key, job["id"]),
                "dom": dump_dom(page),
                "screenshot": screenshot(page, "flower-task-progress.png", height=1000),
            }
    finally:
        os.kill(worker.popen.pid, signal.SIGCONT)
    done = client.wait(job["id"], poll_seconds=0.5, timeout=300)
    wait_until(
        lambda: any(e.get("job_id") == job["id"] and e["shard"] == ROWS // 4 - 1 for e in listener.events),
        10,
        "last shard's events",
    )
    listener.stop()
    return {
        "job": done,
        "frozen": frozen,
        "events": [e for e in listener.events if e.get("job_id") == job["id"]],
    }


def in_progress(flower_url: str, job_id: str) -> dict[str, dict]:
    return {task_id: t for task_id, t in shard_tasks(flower_url, job_id).items() if t["state"] == "PROGRESS"}


def shard_tasks(flower_url: str, job_id: str) -> dict[str, dict]:
    response = httpx.get(f"{flower_url}/api/tasks", params={"taskname": TASK_RUN_SHARD}, timeout=5)
    return {task_id: task for task_id, task in response.json().items() if job_id in (task["args"] or "")}


def freight_status(api_url: str, key: str, job_id: str) -> str:
    """Runs `freight status` in this process; returns the progress line it prints on stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert freight_main(["status", job_id, "--api-url", api_url, "--api-key", key]) == 0
    assert json.loads(out.getvalue())["id"] == job_id  # stdout stays the job's JSON
    return err.getvalue().strip()


def test_flower_shows_each_shard_task_with_its_progress(flower_url: str, watched_job: dict) -> None:
    job, frozen = watched_job["job"], watched_job["frozen"]
    assert job["status"] == "completed" and frozen, "never caught a shard in progress"
    # While the shard ran, Flower showed its progress event: state PROGRESS, result rows/total, tokens/s.
    progress = json.loads(frozen["task"]["result"])
    assert progress["job_id"] == job["id"] and progress["rows_total"] == 4 and 0 <= progress["rows_done"] < 4
    assert progress["tokens_per_s"] > 0 and frozen["task"]["args"] == f"['{job['id']}', {progress['shard']}]"
    dom = frozen["dom"]
    assert TASK_RUN_SHARD in dom and job["id"] in dom and "PROGRESS" in dom and "tokens_per_s" in dom
    image = frozen["screenshot"]
    assert image.stat().st_size > 10_000 and png_colors(image) > 50
    # Every shard sent progress events on the broker (what Flower reads).
    assert {e["shard"] for e in watched_job["events"]} == set(range(ROWS // 4))

    # After the job, Flower has every shard task, named and with its arguments, and each result
    # keeps the final numbers.
    wait_until(
        lambda: (
            [t["state"] for t in shard_tasks(flower_url, job["id"]).values()] == ["SUCCESS"] * (ROWS // 4)
        ),
        30,
        "every shard task finished in flower",
    )
    tasks = shard_tasks(flower_url, job["id"])
    assert sorted(json.loads(t["args"].replace("'", '"'))[1] for t in tasks.values()) == list(
        range(ROWS // 4)
    )
    for task in tasks.values():
        result = task["result"]
        assert "'rows_done': 4" in result and "'rows_total': 4" in result and "'tokens_per_s'" in result


def test_status_shows_a_progress_bar_with_rate_and_eta(
    watched_job: dict, api_url: str, api_keys: dict
) -> None:
    running_line = watched_job["frozen"]["status_line"]
    assert running_line.startswith("rows [#") and "in_progress" in running_line, running_line
    assert "tok/s" in running_line and "ETA " in running_line, running_line
    finished = freight_status(api_url, api_keys["acme"], watched_job["job"]["id"])
    assert finished.startswith(f"rows [{'#' * 30}] 100% {ROWS}/{ROWS}, completed"), finished
    # The line itself, from a running job's numbers.
    job = {"status": "in_progress", "request_counts": {"total": 400, "completed": 100, "failed": 20}}
    line = JobProgress.of(job, {"tokens_per_second": 1234.5, "rows_per_second": 2.0}).line()
    assert line == f"rows [{'#' * 9}{'.' * 21}]  30% 120/400, in_progress, 1,234 tok/s, ETA 2:20"


def test_the_job_report_is_one_page_with_plots(
    watched_job: dict, client: FreightClient, api_url: str, api_keys: dict, tmp_path: Path
) -> None:
    job_id = watched_job["job"]["id"]
    out = tmp_path / "report.html"
    assert (
        freight_main(["report", job_id, "-o", str(out), "--api-url", api_url, "--api-key", api_keys["acme"]])
        == 0
    )
    html = out.read_text()
    assert html == client.report_html(job_id)
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    metrics = client.metrics(job_id)
    assert f'data-key="output_tokens">{metrics["output_tokens"]:,}<' in html
    assert f'data-key="shards">{metrics["shards"]}<' in html
    # The quote at submission beside what the job took (jobs/domain/report.py quote_section).
    assert f'data-key="actual_output_tokens">{metrics["output_tokens"]:,}<' in html
    assert 'data-key="quoted_output_tokens">' in html and 'data-key="quoted_eta_seconds">' in html
    # The time series came from the worker: several samples over this multi-second job.
    assert html.count("<polyline") >= 3 * (ROWS // 4)  # one line per shard in each of three charts
    check_report_in_chromium(out.as_uri(), job_id, "job-report.png")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_metrics_on_the_api_and_the_worker(
    watched_job: dict, api_url: str, worker: Process, service_env: ServiceEnv
) -> None:
    api = scrape(f"{api_url}/metrics")
    assert api[("freight_database_up", ())] == 1
    assert api[("freight_jobs", (("status", "completed"),))] >= 1
    assert ("freight_jobs", (("status", "cancelling"),)) in api  # every status is reported, zeros too
    assert api[("freight_rows_accepted_total", ())] >= ROWS
    latency = {
        labels: value
        for (name, labels), value in api.items()
        if name == "freight_http_request_duration_seconds_count"
    }
    assert latency[(("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "200"))] >= 3
    assert latency[(("method", "POST"), ("route", "/v1/jobs"), ("status", "201"))] >= 1

    metrics = scrape(worker.metrics_url)
    assert metrics[("freight_worker_model_loaded", (("model", service_env.settings.default_model),))] == 1
    assert metrics[("freight_worker_rows_done_total", ())] >= ROWS
    assert metrics[("freight_worker_shards_total", (("outcome", "done"),))] >= ROWS // 4
    assert metrics[("freight_worker_generated_tokens_total", ())] >= ROWS
    assert metrics[("freight_worker_kv_cache_blocks", ())] > 0
    assert 0 < metrics[("freight_worker_peak_kv_cache_utilization", ())] <= 1
    for gauge in (
        "freight_worker_tokens_per_second",
        "freight_worker_running_batch_size",
        "freight_worker_kv_cache_utilization",
        "freight_worker_preemptions_total",
    ):
        assert (gauge, ()) in metrics, gauge
