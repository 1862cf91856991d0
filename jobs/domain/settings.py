"""The one settings object shared by the API, the worker and the CLI (env prefix FREIGHT_)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from platformdirs import user_cache_dir
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path(user_cache_dir("freight"))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FREIGHT_", extra="ignore")

    home: Path = default_home()  # models cache, embedded database, job files
    database_url: str | None = None  # None: SQLite under home (embedded default)
    broker_url: str | None = None  # None: run jobs in-process (embedded default)
    data_dir: Path | None = None  # None: home / "data"
    shard_size: int = Field(1024, ge=1)  # 4 x max_num_seqs: a shard ramps up and drains its batch once
    device_hour_usd: float = Field(0.10, ge=0)
    max_upload_mb: int = Field(512, ge=1)
    default_model: str = "smollm2-135m"
    # Models the API accepts (aliases or folder paths); each has its own Celery queue.
    models: list[str] = Field(default_factory=lambda: ["smollm2-135m"])
    # "auto": the compute dtype and INT8 scheme measured fastest on the worker's machine (path_plan.py)
    quantization: str | None = "auto"
    kv_cache_dtype: str = "int8"
    dtype: str = "auto"
    # CPU INT8 GEMM; "auto": measured. Where two backends measure alike (the AMX machine: within 3%) the pick,
    # and with it the exact tokens, can differ between machines or fresh calibrations: pin it to rule that out
    int8_backend: Literal["auto", "int_mm", "onednn", "amx"] = "auto"
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    # Cap on every model's context (tokens). None: each model's own (its max_position_embeddings, as a
    # worker recorded it in the model registry); see jobs/domain/served_models.py.
    max_model_len: int | None = Field(None, ge=2)
    num_threads: int | None = None  # torch threads in the worker; None keeps torch's default
    # engine optimisations, on by default (README "Engine"); off only to measure what they bring
    enable_prefix_caching: bool = True
    enable_speculation: bool = True
    # the API asks the grammar engine (a child process) whether it accepts a submitted schema or regex,
    # so a refused one is a 4xx naming the row; off, the worker fails such a row alone
    grammar_check: bool = True

    # Service
    api_url: str = "http://127.0.0.1:8000"  # where the CLI and client find the API
    api_key: str | None = None  # bearer key the CLI and client send
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    flower_port: int = 5555
    # Prometheus metrics of each `freight worker` (prometheus-client's server); None: not served.
    # Each worker on a host needs its own port (`freight worker --metrics-port`).
    worker_metrics_port: int | None = None
    worker_metrics_host: str = "127.0.0.1"
    queue_prefix: str = "freight"  # Celery queue names are <prefix>.<model>
    result_chunk_rows: int = Field(64, ge=1)  # result rows per bulk insert
    result_flush_seconds: float = 2.0  # flush a partial chunk after this long
    # A shard's lease in Postgres: a worker renews it while it runs; another worker may take the
    # shard over only after it lapses. A task redelivered while the lease is held looks again later.
    shard_lease_seconds: float = 120.0
    broker_visibility_timeout: int = 3600  # seconds before Redis redelivers an unacked shard task
    # The API re-sends tasks the broker lost (see jobs/domain/recovery.py) after two sweeps this far apart.
    recovery_interval_seconds: float = Field(30.0, gt=0)
    shard_max_attempts: int = 3  # after this many failed runs a shard's rows become error rows
    cancel_poll_seconds: float = 1.0  # how often a running shard checks for cancellation
    timeline_max_points: int = 200  # bounded time series per shard (tokens/s, batch, KV use)

    @field_validator("quantization", mode="before")
    @classmethod
    def _none_means_off(cls, value: object) -> object:
        return None if isinstance(value, str) and value.lower() in ("", "none", "off") else value

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
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * 1024 * 1024

    def accepted_models(self) -> list[str]:
        return list(dict.fromkeys([self.default_model, *self.models]))
