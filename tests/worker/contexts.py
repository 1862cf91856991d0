"""An in-process worker context on a real Postgres database, shared by the shard-runner tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from jobs.domain.settings import Settings, blob_store
from storage.db import make_engine, make_session_factory
from worker.shard.context import WorkerContext


@contextmanager
def worker_context(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, **overrides
) -> Iterator[WorkerContext]:
    """Small engine limits and one torch thread, so shards of the tiny model run fast beside other tests.
    Job files go where the settings say: the data folder, or `storage_url=` (and `s3_endpoint_url=`)."""
    limits = dict(
        shard_size=8,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        kv_cache_memory_gb=0.25,
        num_threads=1,
        result_chunk_rows=2,
    )
    settings = Settings(
        database_url=pg_url,
        home=tmp_path_factory.mktemp("home"),
        data_dir=tmp_path_factory.mktemp("data"),
        **{**limits, **overrides},  # a test may replace any of the limits
    )
    engine = make_engine(pg_url)
    try:
        yield WorkerContext(
            settings=settings, sessions=make_session_factory(engine), blobs=blob_store(settings)
        )
    finally:
        engine.dispose()
