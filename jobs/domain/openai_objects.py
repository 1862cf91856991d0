"""The objects of OpenAI's Batch API, field for field as OpenAI's API reference (and its `openai` SDK)
defines them: the file, the batch with its request counts, usage and errors, the list pages, the lines
of a batch's input file and of its output and error files. The service returns these (the OpenAPI page
shows them) and writes the output and error files from them; tests/service/test_openai_batch.py checks
them against the SDK's own types.

Fields Freight never fills are still here (as null), so a client's parser finds every field it knows.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field

FilePurpose = Literal[
    "assistants", "assistants_output", "batch", "batch_output", "fine-tune", "fine-tune-results", "vision",
    "user_data",
]  # fmt: skip
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class OpenAIObject(BaseModel):
    """Every field of an answer is always sent (null where unset), so the schema marks every one required."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class Listed(OpenAIObject):
    """An object a list page holds: the page's cursors are its ids."""

    id: str


T = TypeVar("T", bound=Listed)


class FileObject(Listed):
    """A file (OpenAI's `File` object): a batch's input, or its output or error file."""

    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"  # deprecated by OpenAI; always processed
    status_details: str | None = None  # deprecated by OpenAI
    expires_at: int | None = None  # Freight's files do not expire


class FileDeleted(OpenAIObject):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchRequestCounts(OpenAIObject):
    total: int
    completed: int
    failed: int


class InputTokensDetails(OpenAIObject):
    cached_tokens: int  # prompt tokens read from the prefix cache


class OutputTokensDetails(OpenAIObject):
    reasoning_tokens: int = 0  # Freight runs no reasoning models' hidden tokens


class BatchUsage(OpenAIObject):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchError(OpenAIObject):
    """Why a batch failed: one refused line (`line` 1-based), or the whole file (`line` null)."""

    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class Batch(Listed):
    """A batch (OpenAI's `Batch` object). Its status and timestamps are its job's (openai_service.py)."""

    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts | None = None
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None


class ListPage(OpenAIObject, Generic[T]):
    """A cursor page, newest first: pass `last_id` as `after` for the next page while `has_more`."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[T], has_more: bool) -> Self:
        return cls(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )


class FileList(ListPage[FileObject]):
    pass


class BatchList(ListPage[Batch]):
    pass


# ---- the lines of a batch's files ----------------------------------------------------------------


class BatchRequestInput(BaseModel):
    """One line of a batch's input file. The body is read by the endpoint's rules (openai_batch.py), each
    problem that line's error, so it stays an open object here."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class CompletionUsage(OpenAIObject):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionMessage(OpenAIObject):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatCompletionChoice(OpenAIObject):
    index: int
    message: ChatCompletionMessage
    logprobs: None = None  # logprobs are not offered
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class ChatCompletion(OpenAIObject):
    """The body of a /v1/chat/completions answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class CompletionChoice(OpenAIObject):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length", "content_filter"]


class Completion(OpenAIObject):
    """The body of a /v1/completions answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ErrorDetail(OpenAIObject):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(OpenAIObject):
    """The body of a refused request (OpenAI's error response)."""

    error: ErrorDetail


class BatchResponse(OpenAIObject):
    status_code: int
    request_id: str
    body: ChatCompletion | Completion | ErrorBody


class BatchLineError(OpenAIObject):
    code: str
    message: str


class BatchRequestOutput(OpenAIObject):
    """One line of a batch's output file (a response) or error file (an error, and the 400 response of a
    refused line)."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchLineError | None
