"""The one settings object shared by the API, the worker and the CLI (env prefix FREIGHT_)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from platformdirs import user_cache_dir
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from jobs.domain.engine_settings import EngineSettings
from jobs.domain.input_uris import parse_allow_list
from jobs.domain.json_limits import JsonLimits
from storage.blobs import BlobStore
from storage.storage_url import endpoint_parts, parse_storage_url


def default_home() -> Path:
    return Path(user_cache_dir("freight"))


class Settings(EngineSettings):
    # The engine settings (dtype, quantization, max_num_seqs, ...) come from EngineSettings: derived from
    # the engine's own options (jobs/domain/engine_options.py), they are not listed here.
    model_config = SettingsConfigDict(env_prefix="FREIGHT_", extra="ignore")

    home: Path = Field(
        default_home(),
        description="Freight's own directory: the models cache (`models/`), the embedded SQLite database, the "
        "calibration cache and, unless `FREIGHT_DATA_DIR` says otherwise, job files.",
    )
    database_url: str | None = Field(
        None,
        description="Database URL. Unset: SQLite under `FREIGHT_HOME` (the embedded default of `freight run`). "
        "The service needs Postgres: `postgresql+psycopg://user:pass@host/db`.",
    )
    broker_url: str | None = Field(
        None,
        description="Celery broker, `redis://host:6379/0`; the API and the workers need it. "
        "Unset: jobs run in-process (the embedded default).",
    )
    data_dir: Path | None = Field(
        None,
        description="Job files (inputs, results, metrics) when `FREIGHT_STORAGE_URL` is unset; unset itself: "
        "`FREIGHT_HOME/data`. With an S3 store it is only this host's scratch (writes spool here before "
        "their upload), so each host may have its own. `freight run` always keeps its files here.",
    )
    storage_url: str | None = Field(
        None,
        description="Where job files live: `file:///path` (a folder the API and every worker see) or "
        "`s3://bucket/prefix` (an S3-compatible bucket; credentials and region from the standard "
        "`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`). "
        "Unset: `file://` + `FREIGHT_DATA_DIR`, as before ([Job files](storage.md)).",
    )
    s3_endpoint_url: str | None = Field(
        None,
        description="Endpoint of a non-AWS S3 service (MinIO, SeaweedFS, Ceph RGW, R2), `http(s)://host:port`. "
        "Unset: AWS S3.",
    )
    input_allow: list[str] = Field(
        default_factory=list,
        description="What a job may name as its input by reference: `s3://bucket/prefix` entries (a JSON list in "
        "the environment), read with the store's S3 settings above. A URI not under one of them, and any other "
        "scheme, is refused with a 4xx. Empty: inputs by reference are disabled ([Job files](storage.md)).",
    )
    shard_size: int = Field(
        1024,
        ge=1,
        description="Rows per shard (one Celery task). A shard fills the batch at its start and drains it at its "
        "end, so a few times `max_num_seqs` keeps the batch full.",
    )
    device_hour_usd: float = Field(
        0.10,
        ge=0,
        description="Price of one device-hour, for the cost metrics "
        "(`cost_usd = device_seconds / 3600 x device_hour_usd`).",
    )
    max_upload_mb: int = Field(
        512,
        ge=1,
        description="Largest accepted upload, in MiB; a larger one gets a 413 before anything is stored.",
    )
    default_model: str = Field(
        "smollm2-135m", description="Model of jobs that name none, and of `freight worker` without `--model`."
    )
    models: list[str] = Field(
        default_factory=lambda: ["smollm2-135m"],
        description="Models the API accepts (aliases or folder paths; a JSON list in the environment). "
        "Each has its own Celery queue, `<prefix>.<model>`.",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Cap on every model's context, in tokens. Unset: each model's own (its "
        "`max_position_embeddings`, as a worker recorded it in the model registry; 2,048 for a model not "
        "recorded yet); see `jobs/domain/served_models.py`.",
    )
    grammar_check: bool = Field(
        True,
        description="The API asks the grammar engine (a child process) whether it accepts a submitted JSON schema "
        "or regex, so a refused one is a 4xx naming the row; off, the worker fails such a row alone.",
    )
    grammar_budget_seconds: float = Field(
        10.0,
        gt=0,
        description="Time one submission may spend asking the grammar engine about its constraints, all of "
        "them together; over it the submission is a 422 (docs/input-rules.md).",
    )
    json_limits: JsonLimits = Field(
        default_factory=JsonLimits,
        description="Limits of every JSON the API parses (request bodies, params, JSONL lines; json_schema strings "
        "have fixed limits of their own), "
        'as a JSON object: `{"max_bytes", "max_depth", "max_number_chars", "max_keys"}` (docs/input-rules.md).',
    )
    body_idle_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="A request body that stops arriving for this long is answered 408 and its connection "
        "closed (a client that promises 2 MB and sends 1 KB holds nothing for long).",
    )

    # Service
    api_url: str = Field(
        "http://127.0.0.1:8000", description="Where the CLI and the Python client find the API."
    )
    api_key: str | None = Field(None, description="Bearer key the CLI and the Python client send.")
    api_host: str = Field("127.0.0.1", description="Address `freight api` listens on.")
    api_port: int = Field(8000, description="Port `freight api` listens on.")
    flower_port: int = Field(5555, description="Port `freight flower` listens on.")
    worker_metrics_port: int | None = Field(
        None,
        description="Port of a worker's Prometheus metrics (prometheus-client's server). Unset: not served. "
        "Each worker on a host needs its own port (`freight worker --metrics-port` overrides).",
    )
    worker_metrics_host: str = Field(
        "127.0.0.1", description="Address a worker's Prometheus metrics listen on."
    )
    queue_prefix: str = Field("freight", description="Celery queue names are `<prefix>.<model>`.")
    result_chunk_rows: int = Field(64, ge=1, description="Result rows per bulk insert.")
    result_flush_seconds: float = Field(
        2.0, description="A partial chunk of result rows is inserted after this many seconds."
    )
    shard_lease_seconds: float = Field(
        120.0,
        description="A shard's lease in Postgres: the worker renews it every quarter of this while the shard runs; "
        "another worker may take the shard over only after it lapses.",
    )
    broker_visibility_timeout: int = Field(
        3600,
        description="Seconds before Redis redelivers an unacknowledged shard task. A redelivered task whose shard's "
        "lease is still held looks again every half lease instead of running the shard twice.",
    )
    recovery_interval_seconds: float = Field(
        30.0,
        gt=0,
        description="How often the API sweeps for shard tasks the broker lost (re-sent when missing on two sweeps "
        "this far apart; see `jobs/domain/recovery.py`) and expires overdue batches.",
    )
    shard_max_attempts: int = Field(
        3,
        description="Failed runs of a shard before its remaining rows become error rows (the job still finishes).",
    )
    cancel_poll_seconds: float = Field(1.0, description="How often a running shard checks for cancellation.")
    timeline_max_points: int = Field(
        200,
        description="Samples of tokens/s, batch size and KV use kept per shard (the job report's plots).",
    )
    worker_class: str | None = Field(
        None,
        max_length=200,
        description="This worker's class in the throughput profiles that quotes price jobs with (each finished "
        "shard adds its measured tokens and seconds to its model's row for the class). Unset: the engine's "
        "tier (`avx512`, `amx`, `cuda`, ...); set it where one tier covers different machines (two GPU kinds).",
    )
    quote_assumed_workers: int = Field(
        1,
        ge=1,
        description="Workers a quote's ETA assumes for a model when no worker process has written a shard "
        "attempt of that model within the last shard lease (Postgres sees busy workers only, not idle ones).",
    )
    fair_share: bool = Field(
        True,
        description="Share a model's workers between tenants queued at one priority class in proportion to "
        "`FREIGHT_TENANT_WEIGHTS` ([Scheduling](scheduling.md)). Off: earliest deadline, then submission order.",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description='Fair-share weight per tenant, a JSON object such as `{"acme": 2}`; a tenant not named '
        "weighs 1.",
    )
    fair_share_window_seconds: float = Field(
        600.0,
        gt=0,
        description="Fair share counts a tenant's running shards plus those it finished within this many "
        "seconds (so one worker alternates between tenants too).",
    )
    result_cache_ttl_seconds: float = Field(
        30 * 86400.0,
        gt=0,
        description="A result cache entry is reused for this long after it was stored (30 days); older ones "
        "are never reused and are deleted, at lookup and by the API's recovery sweep "
        "([Result cache](result-cache.md)).",
    )

    @field_validator("storage_url")
    @classmethod
    def _storage_url_known(cls, value: str | None) -> str | None:
        if value is not None:
            parse_storage_url(value)  # a mistyped URL fails when the settings load, not at the first job
        return value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint_url_known(cls, value: str | None) -> str | None:
        if value is not None:
            endpoint_parts(value)
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _weights_positive(cls, value: dict[str, float]) -> dict[str, float]:
        for tenant, weight in value.items():
            if not weight > 0:
                raise ValueError(f"the weight of tenant {tenant!r} must be above 0, not {weight}")
        return value

    @field_validator("input_allow")
    @classmethod
    def _input_allow_known(cls, value: list[str]) -> list[str]:
        parse_allow_list(value)  # a mistyped entry fails when the settings load
        return value

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or self.embedded_database_url

    @property
    def embedded_database_url(self) -> str:
        return f"sqlite:///{self.home / 'freight.db'}"

    @cached_property
    def resolved_data_dir(self) -> Path:
        return self.data_dir or self.home / "data"

    @property
    def resolved_storage_url(self) -> str:
        return self.storage_url or self.resolved_data_dir.absolute().as_uri()

    @property
    def spool_dir(self) -> Path:
        """This host's scratch for writes bound for an object store (storage/blobs.py)."""
        return self.resolved_data_dir / "spool"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * 1024 * 1024

    def accepted_models(self) -> list[str]:
        return list(dict.fromkeys([self.default_model, *self.models]))


def blob_store(settings: Settings) -> BlobStore:
    """The store of job files the settings name (FREIGHT_STORAGE_URL), for the API and the workers."""
    return BlobStore.from_url(
        settings.resolved_storage_url, endpoint_url=settings.s3_endpoint_url, spool_dir=settings.spool_dir
    )
