"""The one settings object shared by the API, the worker and the CLI (env prefix FREIGHT_)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from platformdirs import user_cache_dir
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path(user_cache_dir("freight"))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FREIGHT_", extra="ignore")

    home: Path = default_home()  # models cache, embedded database, job files
    database_url: str | None = None  # None: SQLite under home (embedded default)
    broker_url: str | None = None  # None: run jobs in-process (embedded default)
    data_dir: Path | None = None  # None: home / "data"
    shard_size: int = 256
    device_hour_usd: float = 0.10
    max_upload_mb: int = 512
    default_model: str = "smollm2-135m"
    quantization: str | None = "int8"
    kv_cache_dtype: str = "int8"
    dtype: str = "bfloat16"
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'freight.db'}"

    @cached_property
    def resolved_data_dir(self) -> Path:
        return self.data_dir or self.home / "data"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"
