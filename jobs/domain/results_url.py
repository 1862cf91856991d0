"""A job's final results as a pre-signed S3 URL (`GET /v1/jobs/{id}/results/url`): handed to the job's
own tenant only (another tenant's job is a 404, as on every route), and only for a results file that
exists on an S3 store (a local folder has no URL to sign: 409 saying to download through the API)."""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel, Field

from jobs.domain.errors import Conflict
from jobs.domain.service import JobService
from storage.blobs import results_name
from storage.models import utcnow
from storage.presign import MAX_EXPIRY, presigned_get_url
from storage.status import FINAL_JOB_STATUSES

DEFAULT_EXPIRY_S = 3600
MAX_EXPIRY_S = int(MAX_EXPIRY.total_seconds())


class ResultsURL(BaseModel):
    url: str = Field(description="GET it with no credentials until expires_at (a SigV4 query signature)")
    expires_at: datetime
    expires_in: int = Field(description="seconds the URL is valid for, from when it was made")


def results_url(jobs: JobService, tenant: str, job_id: str, expires_in_s: int) -> ResultsURL:
    job = jobs.get(tenant, job_id)  # NotFound (404) for a job of another tenant, before anything else
    if jobs.blobs.is_local:
        raise Conflict(
            f"job files are in a local folder (FREIGHT_STORAGE_URL {jobs.blobs.url}), which has no pre-signed "
            f"URLs; download the results from GET /v1/jobs/{job_id}/results"
        )
    name = results_name(job_id)
    if job.status not in FINAL_JOB_STATUSES or not jobs.blobs.exists(name):
        raise Conflict(
            f"job {job_id} is {job.status.value}: its results file is written when the job is final; "
            f"GET /v1/jobs/{job_id}/results streams the rows finished so far"
        )
    expires_in = timedelta(seconds=expires_in_s)
    made_at = utcnow()
    url = presigned_get_url(jobs.blobs, name, expires_in, jobs.settings.s3_endpoint_url)
    return ResultsURL(url=url, expires_at=made_at + expires_in, expires_in=expires_in_s)
