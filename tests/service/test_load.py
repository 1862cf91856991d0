"""Load: 50 submissions at once from an async client against a real `freight api` and one
`freight worker` (tiny model): every one is accepted, and every job completes with all its rows."""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.service.fixtures import Process

pytestmark = pytest.mark.slow
JOBS = 50
ROWS = 3


def job_file(number: int) -> bytes:
    sink = io.BytesIO()
    table = pa.table(
        {
            "custom_id": [f"j{number}-r{i}" for i in range(ROWS)],
            "prompt": [f"Job {number}, row {i}" for i in range(ROWS)],
        }
    )
    pq.write_table(table, sink)
    return sink.getvalue()


async def submit_all(api_url: str, key: str) -> tuple[list[httpx.Response], float]:
    limits = httpx.Limits(max_connections=JOBS)
    async with httpx.AsyncClient(
        base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=120, limits=limits
    ) as client:
        started = time.monotonic()
        responses = await asyncio.gather(
            *(
                client.post(
                    "/v1/jobs",
                    files={"file": (f"job{n}.parquet", job_file(n))},
                    data={"params": json.dumps({"max_tokens": 2, "metadata": {"n": str(n)}})},
                )
                for n in range(JOBS)
            )
        )
        return list(responses), time.monotonic() - started


async def wait_all(api_url: str, key: str, job_ids: list[str], timeout: float) -> dict[str, dict]:
    async with httpx.AsyncClient(
        base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as client:
        deadline = time.monotonic() + timeout
        finished: dict[str, dict] = {}
        while len(finished) < len(job_ids) and time.monotonic() < deadline:
            pending = [job_id for job_id in job_ids if job_id not in finished]
            for job in await asyncio.gather(*(client.get(f"/v1/jobs/{job_id}") for job_id in pending)):
                body = job.json()
                if body["status"] in ("completed", "failed", "cancelled"):
                    finished[body["id"]] = body
            await asyncio.sleep(1)
        results = await asyncio.gather(*(client.get(f"/v1/jobs/{job_id}/results") for job_id in finished))
        for job_id, response in zip(finished, results, strict=True):
            finished[job_id]["results"] = pq.read_table(io.BytesIO(response.content)).to_pylist()
        return finished


def test_fifty_concurrent_submissions_are_all_accepted_and_completed(
    api_url: str, api_keys: dict[str, str], worker: Process
) -> None:
    key = api_keys["acme"]
    responses, submit_seconds = asyncio.run(submit_all(api_url, key))
    assert [r.status_code for r in responses] == [201] * JOBS, [
        r.text for r in responses if r.status_code != 201
    ]
    jobs = [r.json() for r in responses]
    assert len({job["id"] for job in jobs}) == JOBS
    assert [job["metadata"]["n"] for job in jobs] == [str(n) for n in range(JOBS)]

    finished = asyncio.run(wait_all(api_url, key, [job["id"] for job in jobs], timeout=240))
    assert len(finished) == JOBS, f"{JOBS - len(finished)} jobs did not finish"
    for n, job in enumerate(jobs):
        done = finished[job["id"]]
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": ROWS, "completed": ROWS, "failed": 0}
        assert [row["custom_id"] for row in done["results"]] == [f"j{n}-r{i}" for i in range(ROWS)]
    print(f"50 concurrent submissions accepted in {submit_seconds:.2f}s")
