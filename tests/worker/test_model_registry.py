"""The worker's side of the model registry, on Postgres: loading a model records its family and own
context, and the engine runs with the context the API checks jobs against; a model the engine cannot load
is recorded with the loader's refusal, its shard fails at once (no retries) with that error on its rows
and on the job, which ends failed, while the pool goes on serving; `freight run` records the model before
validating, so it refuses such a model before a job exists and takes a model's own context."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from jobs.domain.errors import InputError
from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from storage import job_store
from storage.blobs import results_name
from storage.db import make_engine, make_session_factory
from storage.model_store import get_model
from storage.shard_store import get_shard
from storage.status import JobStatus, ShardStatus
from tests.conftest import TINY_SHAPE, save_tiny_model
from tests.worker.contexts import worker_context
from worker.embedded import run_embedded
from worker.engine.config import SUPPORTED_MODEL_TYPES
from worker.engine.sampling_params import SamplingParams
from worker.finalize import finalize_job
from worker.llm_pool import EngineKey, LLMPool
from worker.model_registry import ModelRegistry, inspect_model
from worker.shard.context import WorkerContext
from worker.shard.executor import run_shard

TENANT = "model-registry"
OWN_CONTEXT = 4096  # above the 2,048 tokens assumed for a model no worker has recorded


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The tiny random Llama with a 4,096-token context of its own."""
    config = LlamaConfig(**{**TINY_SHAPE, "max_position_embeddings": OWN_CONTEXT}, tie_word_embeddings=True)
    return save_tiny_model(LlamaForCausalLM, config, tmp_path_factory.mktemp("long_llama"), smollm2_path)


@pytest.fixture(scope="module")
def ctx(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerContext]:
    # No cap: each model is served with its own context.
    with worker_context(pg_url, tmp_path_factory, max_model_len=None, kv_cache_memory_gb=0.05) as context:
        yield context


@pytest.fixture(scope="module")
def pool(ctx: WorkerContext) -> LLMPool:
    return LLMPool(ctx.settings, ModelRegistry(ctx.sessions))


def service(ctx: WorkerContext) -> JobService:
    return JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)


def small_engine(model: Path) -> EngineKey:
    return EngineKey(str(model), "float32", None, "auto")  # no calibration: the fast load


def test_loading_records_the_model_and_the_engine_serves_the_context_the_api_checks(
    ctx: WorkerContext, pool: LLMPool, long_llama_dir: Path
) -> None:
    llm = pool.load(small_engine(long_llama_dir))
    with ctx.sessions() as session:
        record = get_model(session, name=str(long_llama_dir))
    assert (record.model_type, record.context_len, record.loadable, record.error) == (
        "llama",
        OWN_CONTEXT,
        True,
        None,
    )
    assert record.recorded_by.split(":")[-1].isdigit()
    assert llm.max_model_len == service(ctx).served(str(long_llama_dir)).context_len == OWN_CONTEXT

    capped = LLMPool(ctx.settings.model_copy(update={"max_model_len": 512}))
    capped_llm = capped.load(small_engine(long_llama_dir))
    try:
        assert capped_llm.max_model_len == 512
    finally:
        capped_llm.close()


def test_a_kv_pool_shorter_than_the_context_cuts_it_and_the_api_checks_the_cut_one(
    ctx: WorkerContext, long_llama_dir: Path
) -> None:
    # float32 KV of the tiny Llama: 2 layers x 2 KV heads x 16 x (K, V) x 4 bytes = 512 bytes a token, so
    # 0.0005 GiB holds 1,048 tokens: 65 blocks of 16, 1,040 tokens, under the model's own 4,096
    small = LLMPool(ctx.settings.model_copy(update={"kv_cache_memory_gb": 0.0005}), ModelRegistry(ctx.sessions))
    llm = small.load(small_engine(long_llama_dir))
    try:
        assert (llm.max_model_len, llm.engine.context_cut) == (1040, True)
        with ctx.sessions() as session:
            assert get_model(session, name=str(long_llama_dir)).context_len == 1040
        assert service(ctx).served(str(long_llama_dir)).context_len == 1040
        # a row asking for more than the pool holds runs to the cut context instead of being refused
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3000, ignore_eos=True))[0]
        assert (out.finish_reason, len(out.output_token_ids)) == ("length", 1037)
    finally:
        llm.close()
        ModelRegistry(ctx.sessions).record(inspect_model(str(long_llama_dir)))  # the model's own again


def test_freight_models_list_shows_each_models_context_and_the_unrecorded_ones(
    ctx: WorkerContext,
    long_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from jobs.cli.main import main

    ModelRegistry(ctx.sessions).record(inspect_model(str(long_llama_dir)))
    monkeypatch.setenv("FREIGHT_DATABASE_URL", ctx.settings.database_url)
    monkeypatch.setenv("FREIGHT_MODELS", json.dumps([str(long_llama_dir), "not-loaded-yet"]))
    monkeypatch.setenv("FREIGHT_MAX_MODEL_LEN", "1024")
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith(f"{long_llama_dir}  llama, context 1,024 tokens (its own 4,096)  [recorded ")
        for line in lines
    ), lines
    assert "not-loaded-yet  not recorded yet: no worker has loaded it (context 1,024 tokens)" in lines


def test_a_shard_of_a_model_the_engine_cannot_load_fails_at_once_and_fails_the_job(
    ctx: WorkerContext, pool: LLMPool, falcon_dir: Path, long_llama_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"custom_id": ["a", "b"], "prompt": ["Hello", "World"]}), source)
    params = JobParams(model=str(falcon_dir), max_tokens=4)
    with open(source, "rb") as upload:  # not recorded yet: accepted, as before the registry
        job_id = service(ctx).submit(TENANT, upload, params).id

    outcome = run_shard(ctx, pool, job_id, 0)  # raises ShardRetry if it would try again
    assert outcome.status == ShardStatus.FAILED and outcome.ready_to_finalize
    refusal = f"model {str(falcon_dir)!r} cannot be served: unsupported architecture 'falcon' in {falcon_dir}"
    supported = f"supported model types are {', '.join(SUPPORTED_MODEL_TYPES)}"
    with ctx.sessions() as session:
        shard = get_shard(session, job_id, 0)
        job = job_store.get_job(session, job_id)
        record = get_model(session, name=str(falcon_dir))
    assert shard.attempts == 1 and shard.error.startswith(refusal) and supported in shard.error
    assert job.error == shard.error
    assert (record.model_type, record.context_len, record.loadable) == ("falcon", None, False)
    assert record.error.startswith(f"unsupported architecture 'falcon' in {falcon_dir}")

    assert finalize_job(ctx, job_id) == JobStatus.FAILED
    rows = pq.read_table(ctx.blobs.path(results_name(job_id))).to_pylist()
    assert [(row["custom_id"], row["finish_reason"], row["error"]) for row in rows] == [
        ("a", "error", job.error),
        ("b", "error", job.error),
    ]

    # Now recorded: the next submission is refused before anything is stored.
    with pytest.raises(InputError) as refused, open(source, "rb") as upload:
        service(ctx).submit(TENANT, upload, params)
    assert refused.value.field == "model" and refused.value.status_code == 422
    assert refused.value.message.startswith(refusal) and supported in refused.value.message
    # and the pool goes on serving a model it can load
    assert pool.load(small_engine(long_llama_dir)).max_model_len == OWN_CONTEXT


def test_freight_run_refuses_a_model_the_engine_cannot_load_before_a_job_exists(
    falcon_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["Hello"]}), source)
    settings = Settings(home=tmp_path / "home", database_url=None, broker_url=None, num_threads=1)
    with pytest.raises(InputError, match="unsupported architecture 'falcon'") as refused:
        run_embedded(source, tmp_path / "out.parquet", {"model": str(falcon_dir), "max_tokens": 4}, settings)
    assert refused.value.field == "model"
    engine = make_engine(settings.embedded_database_url)
    try:
        with make_session_factory(engine)() as session:
            assert job_store.list_jobs(session, "local")[0] == []
            assert get_model(session, name=str(falcon_dir)).loadable is False
    finally:
        engine.dispose()


def test_freight_run_checks_a_job_against_the_models_own_context(
    long_llama_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.parquet"
    # the job's max_tokens is above the 2,048 default; the row asks for two tokens, so it runs fast
    pq.write_table(
        pa.table({"prompt": ["Once upon a time"], "max_tokens": pa.array([2], pa.int64())}), source
    )
    settings = Settings(
        home=tmp_path / "home",
        database_url=None,
        broker_url=None,
        num_threads=1,
        kv_cache_memory_gb=0.05,
        max_num_seqs=4,
        dtype="float32",
        quantization=None,
        kv_cache_dtype="auto",
    )
    params = {"model": str(long_llama_dir), "max_tokens": 3000, "temperature": 0}
    result = run_embedded(source, tmp_path / "out.parquet", params, settings)
    assert result.status == JobStatus.COMPLETED
    assert pq.read_table(result.output_path).column("output_tokens").to_pylist() == [2]
