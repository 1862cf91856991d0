"""Python client for the Freight HTTP API."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.domain.schemas import JobParams
from jobs.domain.settings import Settings
from storage.status import FINAL_JOB_STATUSES

RETRIES_ON_503 = 5


class FreightAPIError(Exception):
    """An error answer: `detail` is the body's `error` object ({message, type, param, code}, and
    row, column or field where they apply), or the body's text when it is not JSON."""

    def __init__(self, status_code: int, detail: Any) -> None:
        fields = detail if isinstance(detail, dict) else {}
        message = fields.get("message", detail)
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.detail = detail
        self.message = message
        self.type: str | None = fields.get("type")
        self.param: str | None = fields.get("param")
        self.code: str | None = fields.get("code")


def _error_detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text
    return body.get("error", body) if isinstance(body, dict) else body


def _params(params: JobParams | dict[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
    """The params JSON of a submission: `params` with `fields` over it."""
    payload = params.model_dump(exclude_unset=True) if isinstance(params, JobParams) else dict(params or {})
    payload.update(fields)
    return payload


def _job_body(
    file: str | Path | bytes | pa.Table, params: JobParams | dict[str, Any] | None, fields: dict[str, Any]
) -> dict[str, Any]:
    """The multipart body of a submission (and of a quote): the Parquet file and the params JSON."""
    payload = _params(params, fields)
    if isinstance(file, pa.Table):
        sink = io.BytesIO()
        pq.write_table(file, sink)
        content, name = sink.getvalue(), "input.parquet"
    elif isinstance(file, bytes):
        content, name = file, "input.parquet"
    else:
        content, name = Path(file).read_bytes(), Path(file).name
    return {
        "files": {"file": (name, content, "application/vnd.apache.parquet")},
        "data": {"params": json.dumps(payload)},
    }


class FreightClient:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        settings: Settings | None = None,
    ) -> None:
        settings = settings or Settings()
        key = api_key or settings.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=base_url or settings.api_url, headers=headers, timeout=timeout)

    def __enter__(self) -> FreightClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self.http.request(method, path, **kwargs)
        for _ in range(RETRIES_ON_503):
            # The service is briefly unavailable (its database or queue restarting): reads are safe to repeat.
            if response.status_code != 503 or method != "GET":
                break
            time.sleep(float(response.headers.get("retry-after", "1")))
            response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise FreightAPIError(response.status_code, _error_detail(response))
        return response

    def submit(
        self,
        file: str | Path | bytes | pa.Table,
        params: JobParams | dict[str, Any] | None = None,
        **param_fields: Any,
    ) -> dict[str, Any]:
        """Upload a Parquet file (path, bytes or an Arrow table) with job params; returns the job."""
        return self._request("POST", "/v1/jobs", **_job_body(file, params, param_fields)).json()

    def submit_by_reference(
        self,
        uris: str | Sequence[str],
        params: JobParams | dict[str, Any] | None = None,
        **param_fields: Any,
    ) -> dict[str, Any]:
        """Submit a job whose input stays in its bucket: one or more s3:// URIs (a file, a folder ending
        in "/", or a glob in the last segment), read in place by the service; returns the job."""
        uri_list = [uris] if isinstance(uris, str) else list(uris)
        payload = {"input_uris": uri_list, "params": _params(params, param_fields)}
        return self._request("POST", "/v1/jobs/by-reference", json=payload).json()

    def quote(
        self,
        file: str | Path | bytes | pa.Table,
        params: JobParams | dict[str, Any] | None = None,
        **param_fields: Any,
    ) -> dict[str, Any]:
        """What `submit` with the same arguments would cost and when it would finish (POST
        /v1/jobs/quote): the same checks, nothing stored or queued. Returns the quote (JobQuote's fields)."""
        return self._request("POST", "/v1/jobs/quote", **_job_body(file, params, param_fields)).json()

    def quote_by_reference(
        self,
        uris: str | Sequence[str],
        params: JobParams | dict[str, Any] | None = None,
        **param_fields: Any,
    ) -> dict[str, Any]:
        """What `submit_by_reference` with the same arguments would cost and when it would finish: the
        files are checked in place, nothing is stored or queued."""
        uri_list = [uris] if isinstance(uris, str) else list(uris)
        payload = {"input_uris": uri_list, "params": _params(params, param_fields)}
        return self._request("POST", "/v1/jobs/quote", json=payload).json()

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}").json()

    def list_jobs(
        self, status: str | None = None, limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        query: dict[str, Any] = {"limit": limit}
        if status:
            query["status"] = status
        if after:
            query["after"] = after
        return self._request("GET", "/v1/jobs", params=query).json()

    def iter_jobs(self, status: str | None = None, page_size: int = 50) -> Iterator[dict[str, Any]]:
        """Every job, newest first, following the cursor page by page."""
        after = None
        while True:
            page = self.list_jobs(status=status, limit=page_size, after=after)
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["last_id"]

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self._request("GET", f"/v1/jobs/{job_id}/events").json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/cancel").json()

    def metrics(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}/metrics").json()

    def report_html(self, job_id: str) -> str:
        """The job report: one self-contained HTML page."""
        return self._request("GET", f"/v1/jobs/{job_id}/report").text

    def results_bytes(self, job_id: str) -> bytes:
        return self._request("GET", f"/v1/jobs/{job_id}/results").content

    def results_table(self, job_id: str) -> pa.Table:
        return pq.read_table(io.BytesIO(self.results_bytes(job_id)))

    def results_url(self, job_id: str, expires_in: int | None = None) -> dict[str, Any]:
        """A pre-signed URL of the final results on an S3 store ({url, expires_at, expires_in}; seconds,
        the service's default when None): any HTTP client can GET it, without the API key, until it
        expires."""
        query = {} if expires_in is None else {"expires_in": expires_in}
        return self._request("GET", f"/v1/jobs/{job_id}/results/url", params=query).json()

    def download_results(self, job_id: str, path: str | Path) -> Path:
        path = Path(path)
        with self.http.stream("GET", f"/v1/jobs/{job_id}/results") as response:
            if response.status_code >= 400:
                response.read()
                raise FreightAPIError(response.status_code, _error_detail(response))
            with open(path, "wb") as sink:
                for chunk in response.iter_bytes():
                    sink.write(chunk)
        return path

    def wait(
        self,
        job_id: str,
        *,
        poll_seconds: float = 1.0,
        timeout: float | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the job reaches completed, failed or cancelled; returns the final job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if on_update is not None:
                on_update(job)
            if job["status"] in FINAL_JOB_STATUSES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout}s")
            time.sleep(poll_seconds)
