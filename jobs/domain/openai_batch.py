"""The OpenAI Batch input file (JSONL, one request a line) as the rows of one Freight job, and the
lines of the output and error files (openai_objects.py). Pure: no database, no files, no HTTP.

A line is `{"custom_id", "method": "POST", "url", "body"}` (BatchRequestInput); its body takes the
chat/completions fields Freight runs (model, messages or prompt, max_tokens / max_completion_tokens,
temperature, top_p, seed, stop, n = 1, response_format text / json_object / json_schema:
structured_spec.py). A problem of one line is that line's error (it goes to the batch's error file); the
other lines run. Sampling values are checked by the job's own rules
(`JobParams` through `job_params`, then the service's `resolve`), so a line is refused for exactly
what a native job is refused for.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.domain.errors import InputError, clip, clip_repr
from jobs.domain.grammar_check import GrammarRefusal
from jobs.domain.json_limits import JsonLimits, JsonRefused, parse_json
from jobs.domain.openai_objects import (
    BatchLineError,
    BatchRequestInput,
    BatchRequestOutput,
    BatchResponse,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionMessage,
    Completion,
    CompletionChoice,
    CompletionUsage,
    ErrorBody,
    ErrorDetail,
)
from jobs.domain.schemas import JobParams, job_params
from jobs.domain.structured_spec import STRUCTURED_COLUMNS, StructuredSpec, as_columns, from_response_format
from jobs.domain.text_rule import repaired
from jobs.domain.validation import MAX_CUSTOM_ID_CHARS

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
MAX_LINES = 50_000  # OpenAI's limit of requests per batch
MAX_NAMED_LINE_ERRORS = 100  # `errors` of a failed batch name at most this many lines
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_DEFAULT_TEMPERATURE = 1.0

# Sampling fields Freight runs, shared by both endpoints (max_completion_tokens: chat only).
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")
# Fields accepted only with the value that changes nothing (what OpenAI does by default).
NEUTRAL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "n": lambda value: type(value) is int and value == 1,
    "stream": lambda value: value is False,
    "logprobs": lambda value: value is False or value is None,
    "presence_penalty": lambda value: type(value) in (int, float) and value == 0,
    "frequency_penalty": lambda value: type(value) in (int, float) and value == 0,
    "user": lambda value: isinstance(value, str),
}
CHAT_FIELDS = {"model", "messages", "max_completion_tokens", "response_format", *SAMPLING_FIELDS}
COMPLETIONS_FIELDS = {"model", "prompt", "echo", *SAMPLING_FIELDS}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

DEFAULT_LINE_LIMITS = JsonLimits()  # the service passes its settings' json_limits

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@dataclass(frozen=True)
class LineError:
    """One refused line: its number (1-based), custom_id when it had a usable one, and why."""

    line: int
    custom_id: str | None
    message: str
    param: str | None = None
    code: str = "invalid_request"

    def as_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "custom_id": self.custom_id,
            "message": self.message,
            "param": self.param,
            "code": self.code,
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> LineError:
        return cls(value["line"], value.get("custom_id"), value["message"], value.get("param"), value["code"])


@dataclass(frozen=True)
class BatchRequest:
    """One good line: what becomes one row of the job."""

    line: int
    custom_id: str
    model: str
    prompt: str | None  # /v1/completions
    messages: list[dict[str, str]] | None  # /v1/chat/completions
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    structured: StructuredSpec | None = None  # from response_format (chat only)


@dataclass
class ParsedBatch:
    endpoint: str
    lines: int  # non-blank lines read
    requests: list[BatchRequest] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.requests[0].model

    def job_params(self, metadata: dict[str, str] | None = None, *, chat_max_tokens: int) -> JobParams:
        return batch_job_params(self.endpoint, self.requests[0], metadata, chat_max_tokens=chat_max_tokens)

    def to_parquet(self) -> bytes:
        """The job's input file: one row per good line, in line order (row i = requests[i])."""
        sink = io.BytesIO()
        pq.write_table(rows_table(self.requests, self.endpoint), sink)
        return sink.getvalue()


def batch_job_params(
    endpoint: str, first: BatchRequest, metadata: dict[str, str] | None = None, *, chat_max_tokens: int
) -> JobParams:
    """The job's parameters: the batch's model and stop list (its first good line's); the rest per row
    (override columns), defaulting as OpenAI does (temperature 1; max_tokens 16 for completions, up to the
    context for chat, which is `chat_max_tokens`)."""
    default_max = chat_max_tokens if endpoint == CHAT_ENDPOINT else COMPLETIONS_DEFAULT_MAX_TOKENS
    payload: dict[str, Any] = {
        "model": first.model,
        "max_tokens": default_max,
        "temperature": OPENAI_DEFAULT_TEMPERATURE,
        "stop": list(first.stop),
    }
    if metadata:
        payload["metadata"] = metadata
    return job_params(payload)


def rows_table(requests: list[BatchRequest], endpoint: str, *, structured: bool | None = None) -> pa.Table:
    """The job's rows of `requests`, in order. The structured columns are there when a request has a
    response_format, or when `structured` says so (a file written in parts keeps one schema)."""
    columns: dict[str, pa.Array] = {"custom_id": pa.array([r.custom_id for r in requests], pa.string())}
    if endpoint == CHAT_ENDPOINT:
        columns["messages"] = pa.array([r.messages for r in requests], MESSAGES_TYPE)
    else:
        columns["prompt"] = pa.array([r.prompt for r in requests], pa.string())
    columns["max_tokens"] = pa.array([r.max_tokens for r in requests], pa.int64())
    columns["temperature"] = pa.array([r.temperature for r in requests], pa.float64())
    columns["top_p"] = pa.array([r.top_p for r in requests], pa.float64())
    columns["seed"] = pa.array([r.seed for r in requests], pa.int64())
    if structured is None:
        structured = any(r.structured is not None for r in requests)
    if structured:  # the native per-row structured columns
        rows = [as_columns(r.structured) for r in requests]
        for name in STRUCTURED_COLUMNS:
            columns[name] = pa.array([row[name] for row in rows], structured_type(name))
    return pa.table(columns)


def structured_type(name: str) -> pa.DataType:
    return pa.list_(pa.string()) if name == "choice" else pa.string()


def parse_batch_file(
    data: bytes,
    endpoint: str,
    check: Callable[[JobParams], object] | None = None,
    grammar_refusal: GrammarRefusal | None = None,
    limits: JsonLimits = DEFAULT_LINE_LIMITS,
) -> ParsedBatch:
    """Every line of `data` either as a request or as a LineError (BatchReader, all at once: a stored
    input file is read line by line instead, jobs/domain/openai_rows.py)."""
    reader = BatchReader(endpoint, check, grammar_refusal, limits)
    requests = list(reader.requests(_lines(data)))
    return ParsedBatch(endpoint=endpoint, lines=reader.lines, requests=requests, errors=reader.errors)


class BatchReader:
    """The lines of an input file as requests, one line at a time, so a file is never held whole: each
    line is a request or a LineError (in `errors`, in line order). `check` runs the service's checks of
    a line's parameters (known model, max_tokens within the context) and raises InputError;
    `grammar_refusal` asks the grammar engine about a line's response_format (grammar_check.py);
    `limits` bound the parsing of each line (json_limits.py). File-level problems (nothing to read, too
    many lines) raise InputError. A batch is one job: one model and one stop list, set by the first good
    line; a later line that names another is that line's error. What it keeps grows with the lines'
    count only (custom_ids, LineErrors), which MAX_LINES bounds."""

    def __init__(
        self,
        endpoint: str,
        check: Callable[[JobParams], object] | None = None,
        grammar_refusal: GrammarRefusal | None = None,
        limits: JsonLimits = DEFAULT_LINE_LIMITS,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise InputError(f"endpoint must be one of {list(ENDPOINTS)}", field="endpoint")
        self.endpoint = endpoint
        self.check = check
        self.grammar_refusal = grammar_refusal
        self.limits = limits
        self.lines = 0  # non-blank lines read
        self.errors: list[LineError] = []
        self.first: BatchRequest | None = None  # sets the batch's model and stop list
        self._seen: dict[str, int] = {}  # custom_id: its line

    def requests(self, lines: Iterable[tuple[int, bytes | None]]) -> Iterator[BatchRequest]:
        """The good requests of (line number, raw line) pairs; a raw line of None was longer than the
        limits' max_bytes (a line reader cut it rather than hold it)."""
        for number, raw in lines:
            self.lines += 1
            if self.lines > MAX_LINES:
                raise InputError(f"the file has more than {MAX_LINES} requests", field="input_file_id")
            try:
                request = self._request(number, raw)
            except _LineProblem as problem:
                self.errors.append(problem.error)
                continue
            yield request
        if self.lines == 0:
            raise InputError("the input file has no requests", field="input_file_id")

    def _request(self, number: int, raw: bytes | None) -> BatchRequest:
        if raw is None:
            max_bytes = self.limits.max_bytes
            _fail(number, None, f"the line is over {max_bytes} bytes; the limit is {max_bytes} (max_bytes)",
                  code="json_limit")  # fmt: skip
        request = _parse_line(number, raw, self.endpoint, self.check, self.limits)
        if request.structured is not None and self.grammar_refusal is not None:
            refused = self.grammar_refusal(request.structured)
            if refused is not None:
                _fail(number, request.custom_id, f"body.response_format: {refused}", "body.response_format")
        if request.custom_id in self._seen:
            _fail(
                number,
                request.custom_id,
                f"custom_id {clip_repr(request.custom_id)} is repeated (first on line "
                f"{self._seen[request.custom_id]}); each request needs its own",
                "custom_id",
                "duplicate_custom_id",
            )
        self._seen[request.custom_id] = number
        first = self.first
        if first is None:
            self.first = request
        elif request.model != first.model:
            message = (
                f"model {clip_repr(request.model)} differs from the batch's {clip_repr(first.model)} "
                f"(line {first.line}); a batch runs one model"
            )
            _fail(number, request.custom_id, message, "body.model")
        elif request.stop != first.stop:
            _fail(number, request.custom_id, f"stop differs from the batch's (line {first.line}); a batch runs "
                  "one stop list", "body.stop")  # fmt: skip
        return request


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            yield number, raw


def read_lines(
    read: Callable[[int], bytes], max_line_bytes: int, chunk_bytes: int = 1 << 20
) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of the non-blank lines of a byte stream, reading `chunk_bytes` at a time: at
    most one chunk and one line are held. A line longer than `max_line_bytes` is not kept: it comes as
    None (its line's error), and the reader skips to the next newline."""
    number, pending, overlong = 1, bytearray(), False
    while chunk := read(chunk_bytes):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if overlong:
                yield number, None
            else:
                pending += chunk[start:end]
                if len(pending) > max_line_bytes:
                    yield number, None
                elif pending.strip():
                    yield number, bytes(pending)
            number, pending, overlong, start = number + 1, bytearray(), False, end + 1
        if not overlong:
            pending += chunk[start:]
            if len(pending) > max_line_bytes:
                overlong, pending = True, bytearray()
    if overlong:
        yield number, None
    elif pending.strip():
        yield number, bytes(pending)


class _LineProblem(Exception):
    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


def _fail(
    number: int, custom_id: str | None, message: str, param: str | None = None, code: str = "invalid_request"
):
    raise _LineProblem(LineError(number, custom_id, f"line {number}: {message}", param, code))


def _parse_line(
    number: int, raw: bytes, endpoint: str, check: Callable[[JobParams], object] | None, limits: JsonLimits
) -> BatchRequest:
    try:
        # Bounded, and every string valid Unicode (text_rule.py); NUL may stay in prompt text, and the
        # fields that are stored (custom_id, model, stop) are checked for it where they are read.
        line = parse_json(raw, "the line", limits, allow_nul=True)
    except JsonRefused as exc:
        code = "invalid_json" if exc.limit in ("json", "text") else "json_limit"
        _fail(number, None, exc.message.removeprefix("the line: ").removeprefix("the line "), code=code)
    if not isinstance(line, dict):
        _fail(number, None, "must be a JSON object", code="invalid_json")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        what = "is missing" if custom_id is None else "must be a non-empty string"
        _fail(number, None, f"custom_id {what}", "custom_id", "missing_custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS or "\x00" in custom_id:
        _fail(
            number,
            None,
            f"custom_id must have at most {MAX_CUSTOM_ID_CHARS} characters and no NUL",
            "custom_id",
        )
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        _fail(number, custom_id, f"unknown field {clip_repr(unknown[0])}", clip(unknown[0]))
    if line.get("method") != "POST":
        _fail(number, custom_id, f'method must be "POST", not {clip_repr(line.get("method"))}', "method")
    if line.get("url") != endpoint:
        _fail(
            number,
            custom_id,
            f"url {clip_repr(line.get('url'))} is not the batch's endpoint {endpoint!r}",
            "url",
            "invalid_url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        _fail(number, custom_id, f"body must be a JSON object, not {_json_type(body)}", "body")
    # Checked above field by field, each problem in words; what passed is the typed line.
    request = BatchRequestInput(custom_id=custom_id, method="POST", url=endpoint, body=body)
    return _parse_body(number, request, check)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _parse_body(
    number: int, line: BatchRequestInput, check: Callable[[JobParams], object] | None
) -> BatchRequest:
    custom_id, body = line.custom_id, line.body
    chat = line.url == CHAT_ENDPOINT
    allowed = CHAT_FIELDS if chat else COMPLETIONS_FIELDS
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL_FIELDS:
            if not NEUTRAL_FIELDS[name](value):
                _fail(number, custom_id, f"{name} = {clip_repr(value)} is not supported", f"body.{name}")
            continue
        _fail(number, custom_id, f"body field {clip_repr(name)} is not supported", f"body.{clip(name)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        _fail(number, custom_id, "body.model must be a non-empty string", "body.model")
    if chat:
        messages = _messages(number, custom_id, body.get("messages"))
        prompt = None
        structured = _response_format(number, custom_id, body.get("response_format"))
    else:
        if body.get("echo") not in (None, False):
            _fail(number, custom_id, "echo = true is not supported", "body.echo")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            _fail(number, custom_id, "body.prompt must be a string (one prompt a line)", "body.prompt")
        messages = None
        structured = None
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            _fail(number, custom_id, "send max_tokens or max_completion_tokens, not both", "body.max_tokens")
        max_tokens = body["max_completion_tokens"]
    sampling = {name: body.get(name) for name in SAMPLING_FIELDS if body.get(name) is not None}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    # The job's own rules (types, ranges, stop limits), then the service's (model, context).
    try:
        params = job_params({"model": model, **sampling})
        if check is not None:
            check(params)
    except InputError as exc:
        message = exc.message.removeprefix("invalid params: ")
        _fail(number, custom_id, f"body: {message}", f"body.{exc.field}" if exc.field != "params" else "body")
    return BatchRequest(
        line=number,
        custom_id=custom_id,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=sampling.get("max_tokens"),
        temperature=float(sampling["temperature"]) if "temperature" in sampling else None,
        top_p=float(sampling["top_p"]) if "top_p" in sampling else None,
        seed=sampling.get("seed"),
        stop=tuple(params.stop),
        structured=structured,
    )


def _messages(number: int, custom_id: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        _fail(number, custom_id, "body.messages must be a non-empty array", "body.messages")
    messages = []
    for index, message in enumerate(value):
        where = f"body.messages[{index}]"
        if not isinstance(message, dict):
            _fail(number, custom_id, f"{where} must be an object", where)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            _fail(
                number, custom_id, f"{where}.{clip(extra[0])} is not supported", f"{where}.{clip(extra[0])}"
            )
        role = CHAT_ROLES.get(message.get("role"))
        if role is None:
            _fail(
                number,
                custom_id,
                f"{where}.role {clip_repr(message.get('role'))} is not one of {sorted(CHAT_ROLES)}",
                f"{where}.role",
            )
        messages.append({"role": role, "content": _content(number, custom_id, message.get("content"), where)})
    return messages


def _content(number: int, custom_id: str, content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                _fail(
                    number, custom_id, f"{where}.content: only text parts are supported", f"{where}.content"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    _fail(number, custom_id, f"{where}.content must be a string or text parts", f"{where}.content")


def _response_format(number: int, custom_id: str, value: Any) -> StructuredSpec | None:
    try:
        return from_response_format(value)
    except ValueError as exc:
        _fail(number, custom_id, str(exc), "body.response_format")


# ---- output and error files ------------------------------------------------------------------


def output_line(
    *,
    batch_id: str,
    row_index: int,
    custom_id: str,
    endpoint: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    output_tokens: int,
) -> BatchRequestOutput:
    """One line of the output file: a 200 response with a chat.completion or text_completion body."""
    total = prompt_tokens + output_tokens
    usage = CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=output_tokens, total_tokens=total)
    suffix = batch_id.removeprefix("batch_")
    body: ChatCompletion | Completion
    if endpoint == CHAT_ENDPOINT:
        message = ChatCompletionMessage(content=text)
        body = ChatCompletion(
            id=f"chatcmpl-{suffix}-{row_index}",
            created=created,
            model=model,
            choices=[ChatCompletionChoice(index=0, message=message, finish_reason=finish_reason)],
            usage=usage,
        )
    else:
        body = Completion(
            id=f"cmpl-{suffix}-{row_index}",
            created=created,
            model=model,
            choices=[CompletionChoice(text=text, index=0, finish_reason=finish_reason)],
            usage=usage,
        )
    return BatchRequestOutput(
        id=f"batch_req_{suffix}_{row_index}",
        custom_id=custom_id,
        response=BatchResponse(status_code=200, request_id=_request_id(batch_id, row_index), body=body),
        error=None,
    )


def error_line(
    *, batch_id: str, key: str, custom_id: str | None, code: str, message: str, status_code: int | None
) -> BatchRequestOutput:
    """One line of the error file. A refused line carries a 400 response (as OpenAI answers a bad
    request); a row that failed, was cancelled or expired carries no response."""
    response = None
    if status_code is not None:
        detail = ErrorDetail(message=message, type="invalid_request_error", code=code)
        response = BatchResponse(
            status_code=status_code, request_id=_request_id(batch_id, key), body=ErrorBody(error=detail)
        )
    return BatchRequestOutput(
        id=f"batch_req_{batch_id.removeprefix('batch_')}_{key}",
        custom_id=custom_id,
        response=response,
        error=BatchLineError(code=code, message=message),
    )


def _request_id(batch_id: str, key: int | str) -> str:
    return f"req_{batch_id.removeprefix('batch_')}_{key}"


def jsonl(lines: list[BatchRequestOutput]) -> bytes:
    # repaired: a stored value that breaks the text rule is written with U+FFFD, never a failed file
    return b"".join(
        json.dumps(repaired(line.model_dump(mode="json")), ensure_ascii=False).encode("utf-8") + b"\n"
        for line in lines
    )
