"""What the API accepts and returns: job parameters, the job object, metrics."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from storage.status import JobStatus

OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "seed")


class JobParams(BaseModel):
    """Job parameters as sent by a client (`params` JSON). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="model alias or path the workers serve; default from settings"
    )
    max_tokens: int = Field(256, ge=1, description="output tokens per row (a `max_tokens` column overrides)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    template: str | None = Field(
        None, description='prompt built from columns, e.g. "Summarize the following document.\\n\\n{text}"'
    )
    prompt_column: str | None = Field(None, description="string column holding the prompt (default: prompt)")
    chat: bool | None = Field(
        None,
        description="wrap each prompt as one user message in the model's chat template; "
        "default: yes for `template` and `messages`, no for a prompt column",
    )
    metadata: dict[str, str] = Field(default_factory=dict)
    quantization: Literal["int8", "none"] | None = Field(None, description="default from settings")
    kv_cache_dtype: Literal["int8", "auto", "bfloat16", "float16", "float32"] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ResolvedParams(BaseModel):
    """Parameters with every default filled in: what is stored with the job and read by workers."""

    model: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    template: str | None
    prompt_column: str | None
    chat: bool | None
    quantization: Literal["int8"] | None
    kv_cache_dtype: str


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class JobObject(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    request_counts: RequestCounts
    params: dict[str, Any]
    metadata: dict[str, str]
    error: str | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
    has_more: bool
    last_id: str | None = Field(None, description="pass as `after` to get the next page")


class JobEventOut(BaseModel):
    status: JobStatus
    at: datetime


class JobMetrics(BaseModel):
    rows: int
    rows_completed: int
    rows_failed: int
    rows_cancelled: int
    prompt_tokens: int
    output_tokens: int
    padding_tokens: int
    computed_tokens: int
    device_seconds: float = Field(description="engine busy time, summed over shards")
    wall_seconds: float = Field(description="first shard started to job finished")
    queue_seconds: float = Field(description="job created to first shard started")
    tokens_per_second: float = Field(description="(prompt + output tokens) / wall_seconds")
    output_tokens_per_second: float
    rows_per_second: float
    device_hour_usd: float
    cost_usd: float = Field(description="device_seconds / 3600 * device_hour_usd")
    cost_per_million_tokens_usd: float
    mean_batch_size: float
    peak_kv_utilization: float
    preemptions: int
    shards: int
