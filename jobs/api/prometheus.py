"""Prometheus metrics of the API at GET /metrics: jobs by status and rows accepted (read from the
database at each scrape, so every API replica reports the same numbers and a restart loses nothing),
and request latency by route (this process). The registry belongs to the app, not the module."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from storage.job_store import jobs_by_status
from storage.status import JobStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class JobsCollector(Collector):
    """Jobs by status and rows accepted, counted in the database when scraped."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("freight_database_up", "1 if the last scrape could read the jobs table")
        engine = getattr(self.app.state, "engine", None)
        if engine is None:
            up.add_metric([], 0)
            yield up
            return
        try:
            by_status = jobs_by_status(engine=engine)
        except Exception:  # the database is down: say so rather than fail the whole scrape
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily("freight_jobs", "Jobs by status", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], by_status.get(status.value, (0, 0))[0])
        yield jobs
        accepted = [value for status, value in by_status.items() if status != JobStatus.VALIDATING]
        yield CounterMetricFamily(
            "freight_jobs_accepted", "Jobs that passed validation", value=sum(count for count, _ in accepted)
        )
        yield CounterMetricFamily(
            "freight_rows_accepted",
            "Rows of jobs that passed validation",
            value=sum(int(r) for _, r in accepted),
        )


def install_metrics(app: FastAPI) -> CollectorRegistry:
    """Add the latency middleware and GET /metrics (unauthenticated, like most scrape targets: it
    shows totals only, no job ids, tenants or content)."""
    registry = CollectorRegistry()
    latency = Histogram(
        "freight_http_request_duration_seconds",
        "API request latency by method, route template and status code",
        ["method", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    registry.register(JobsCollector(app))
    app.state.metrics_registry = registry

    @app.middleware("http")
    async def measure(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            template = getattr(route, "path", "unmatched")
            if template != "/metrics":
                latency.labels(request.method, template, str(status)).observe(time.perf_counter() - started)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return registry
