"""Downloads of job files (jobs/api/downloads.py) from either store: the same bytes and headers, a local
file by FileResponse and an S3 object streamed in chunks."""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.testclient import TestClient

from jobs.api import downloads
from jobs.api.downloads import file_response
from storage.blobs import BlobStore, results_name


def test_a_job_file_downloads_whole_from_either_store(each_store: BlobStore, monkeypatch) -> None:
    monkeypatch.setattr(downloads, "CHUNK_BYTES", 4096)  # several chunks on S3
    data = os.urandom(50_000)
    with each_store.open_output(results_name("j1")) as sink:
        sink.write(data)
    app = FastAPI()

    @app.get("/results")
    def results():
        return file_response(
            each_store.arrow(results_name("j1")),
            media_type="application/vnd.apache.parquet",
            filename="j1-results.parquet",
            headers={"X-Freight-Results": "final"},
        )

    with TestClient(app) as client:
        response = client.get("/results")
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["content-length"] == str(len(data))
    assert response.headers["content-type"] == "application/vnd.apache.parquet"
    assert response.headers["content-disposition"] == 'attachment; filename="j1-results.parquet"'
    assert response.headers["x-freight-results"] == "final"
