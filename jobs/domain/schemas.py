"""What the API accepts and returns: job parameters, the job object, metrics."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jobs.domain import structured_spec
from jobs.domain.deadline import parse_deadline, window_length
from jobs.domain.errors import InputError, clip
from jobs.domain.structured_spec import StructuredSpec
from jobs.domain.summarize_spec import LongDocuments, SummarizeSpec
from jobs.domain.text_rule import tree_problem
from storage.priority import DEFAULT_PRIORITY, PriorityName
from storage.status import JobStatus

OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "seed")
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_SEED = 2**63 - 1  # the engine's seeds are int64


class JobParams(BaseModel):
    """Job parameters as sent by a client (`params` JSON). Unknown keys are refused, and types are strict:
    `"8"` or `true` is not a max_tokens, `"yes"` not a chat flag (an integer is accepted for a float)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str | None = Field(
        None, description="model alias or path the workers serve; default from settings"
    )
    max_tokens: int = Field(256, ge=1, description="output tokens per row (a `max_tokens` column overrides)")
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE, description="0 = greedy; at most 2")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description="stop string")
    truncate: bool = Field(
        False,
        description="cut prompts longer than the context (keeping their start and the chat template) "
        "instead of making them error rows",
    )
    template: str | None = Field(
        None, description='prompt built from columns, e.g. "Summarize the following document.\\n\\n{text}"'
    )
    prompt_column: str | None = Field(None, description="string column holding the prompt (default: prompt)")
    chat: bool | None = Field(
        None,
        description="wrap each prompt as one user message in the model's chat template; "
        "default: yes for `template` and `messages`, no for a prompt column",
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_METADATA_PAIRS,
        description=f"up to {MAX_METADATA_PAIRS} pairs; keys up to {MAX_METADATA_KEY_CHARS} characters, "
        f"values up to {MAX_METADATA_VALUE_CHARS}; stored and returned verbatim",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="compute dtype; auto (the default from settings): the fastest on the worker's CPU"
    )
    quantization: Literal["auto", "int8", "none"] | None = Field(
        None, description="auto (the default from settings): W8A8 where it is measured faster, else none"
    )
    kv_cache_dtype: Literal["int8", "auto", "bfloat16", "float16", "float32"] | None = None
    reuse_results: bool | None = Field(
        None,
        description="reuse the output of an earlier finished row of yours with the same model, numerics, "
        "prompt tokens and sampling instead of running it (docs/result-cache.md); default: yes for greedy "
        "and seeded rows, no for unseeded sampling",
    )
    # The summarize task: the prompts are written for the user, long documents go through windows.
    task: Literal["generate", "summarize"] = Field(
        "generate", description="summarize: summarize the documents in `column`; no prompt needed"
    )
    column: str | None = Field(None, description="summarize: the document column (default: text)")
    style: str | None = Field(
        None, description='summarize: how the summary reads, e.g. "one paragraph" (the default)'
    )
    long_documents: LongDocuments = Field(
        "map_reduce",
        description="summarize, documents longer than the context: map_reduce (summarize overlapping "
        "token windows, then the window summaries) or truncate (keep the start)",
    )
    id_column: str | None = Field(
        None, description="summarize: input column kept in the output (default: custom_id, id or doc_id)"
    )
    # Structured output (at most one; a row's non-null column of the same name overrides it).
    json_schema: str | None = Field(
        None, description="every output is JSON valid against this JSON schema (an object or its JSON text)"
    )
    regex: str | None = Field(None, description="every output matches this regular expression")
    choice: list[str] | None = Field(
        None, max_length=structured_spec.MAX_CHOICES, description="every output is one of these strings"
    )
    # Scheduling (docs/scheduling.md): not stored in the resolved params but on the job itself.
    priority: PriorityName = Field(
        DEFAULT_PRIORITY, description="high, normal or low: shards of a higher class are run first"
    )
    completion_window: str | None = Field(
        None, description='the job is due this long after submission: "30m", "1h", "24h", "7d" (at most 365d)'
    )
    deadline: str | None = Field(
        None, description='the job is due at this ISO 8601 time with its offset, e.g. "2026-12-08T09:00:00Z"'
    )
    strict_deadline: bool = Field(
        False, description="refuse the job (422) when its quote says it cannot meet its deadline"
    )

    @field_validator("completion_window")
    @classmethod
    def _window_readable(cls, value: str | None) -> str | None:
        if value is not None:
            window_length(value)  # raises ValueError with the accepted forms
        return value

    @field_validator("deadline")
    @classmethod
    def _deadline_readable(cls, value: str | None) -> str | None:
        if value is not None:
            parse_deadline(value)
        return value

    @model_validator(mode="after")
    def _one_deadline(self) -> JobParams:
        if self.completion_window is not None and self.deadline is not None:
            raise ValueError("give completion_window or deadline, not both")
        if self.strict_deadline and self.completion_window is None and self.deadline is None:
            raise ValueError("strict_deadline needs a completion_window or a deadline")
        return self

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_as_text(cls, value: Any) -> Any:
        return structured_spec.schema_text(value) if value is not None else None

    @model_validator(mode="after")
    def _one_structured_output(self) -> JobParams:
        if structured_spec.from_params(self.json_schema, self.regex, self.choice) and self.task != "generate":
            raise ValueError("json_schema, regex and choice apply to task generate only")
        return self

    def structured(self) -> StructuredSpec | None:
        return structured_spec.from_params(self.json_schema, self.regex, self.choice)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_are_usable(cls, value: list[str]) -> list[str]:
        for text in value:
            if not text or len(text) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_fits(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not key or len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys must have 1 to {MAX_METADATA_KEY_CHARS} characters")
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata[{key!r}] is longer than {MAX_METADATA_VALUE_CHARS} characters")
        return value


def job_params(payload: Mapping[str, Any]) -> JobParams:
    """`payload` (the `params` JSON object, or the CLI's flags) as JobParams, or an InputError (field
    `params`) whose message names each field at fault: the one check behind the API, the CLI and the
    embedded runner. Every string in it follows the text rule (text_rule.py): params are stored."""
    problem = tree_problem(dict(payload), "")
    if problem is not None:
        raise InputError(f"invalid params: {problem}", field="params")
    try:
        return JobParams.model_validate(dict(payload))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(clip(part, 64) for part in error['loc']) or 'params'}: {clip(error['msg'], 200)}"
            for error in exc.errors()[:5]
        )
        raise InputError(f"invalid params: {problems}", field="params") from exc


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
    truncate: bool = False
    dtype: str = "auto"
    quantization: Literal["auto", "int8"] | None
    kv_cache_dtype: str
    task: Literal["generate", "summarize"] = "generate"
    summarize: SummarizeSpec | None = None
    structured: StructuredSpec | None = None  # json_schema / regex / choice (structured_spec.py)
    reuse_results: bool | None = None  # None: the default rule (jobs/domain/result_cache.py)


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
    priority: PriorityName = DEFAULT_PRIORITY
    deadline: datetime | None = Field(None, description="when the job is due (from its completion window)")
    deadline_warning: str | None = Field(
        None, description="set at submission when the quote's ETA was past the deadline"
    )
    expired_at: datetime | None = Field(None, description="the deadline passed first: the job was cancelled")
    quote: dict[str, Any] | None = Field(
        None, description="the job's quote at submission (the fields of POST /v1/jobs/quote's answer)"
    )


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
    has_more: bool
    last_id: str | None = Field(None, description="pass as `after` to get the next page")


class JobEventOut(BaseModel):
    status: JobStatus
    at: datetime


class ShardExecution(BaseModel):
    """Where some of a job's shards ran: the machine's ISA tier and the path of every engine op."""

    tier: str
    paths: dict[str, str]
    shards: list[int]


class JobMetrics(BaseModel):
    rows: int
    rows_completed: int
    rows_failed: int
    rows_cancelled: int
    prompt_tokens: int
    output_tokens: int
    padding_tokens: int
    computed_tokens: int
    cached_prompt_tokens: int = Field(0, description="prompt tokens whose KV came from the prefix cache")
    draft_tokens: int = Field(0, description="speculative draft tokens the model verified")
    accepted_draft_tokens: int = Field(0, description="draft tokens the model agreed with (emitted without a step)")
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
    model_parameters: int = Field(0, description="the model's parameters")
    active_parameters: int = Field(
        0, description="parameters one token runs through: a mixture of experts counts its top-k experts only"
    )
    model_flops: int = Field(
        0, description="matrix-product FLOPs spent, estimated as 2 x active_parameters x tokens run (attention not counted)"
    )
    shards: int
    execution: list[ShardExecution] = Field(
        default_factory=list, description="the CPU tier (or cuda) and per-op paths the shards ran on"
    )
    documents_split: int = Field(0, description="summarize: documents summarized through token windows")
    windows: int = Field(0, description="summarize: window requests (their tokens are in the totals)")
    reduce_requests: int = Field(0, description="summarize: requests that combined window summaries")
    cached_rows: int = Field(0, description="rows reused from the tenant's result cache instead of run")
    saved_prompt_tokens: int = Field(0, description="prompt tokens of the cached rows (not run)")
    saved_output_tokens: int = Field(0, description="output tokens of the cached rows (not generated)")
    saved_device_seconds: float = Field(
        0.0, description="engine time the cached rows cost when they first ran (saved by reusing them)"
    )
