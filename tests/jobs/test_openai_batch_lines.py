"""The OpenAI batch input file, line by line: each bad line is that line's error (named by its number),
the good lines become the job's rows, and a file with no good line has nothing to run."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest
from openai.types import Completion as SdkCompletion
from openai.types.chat import ChatCompletion as SdkChatCompletion

from jobs.domain.errors import InputError
from jobs.domain.openai_batch import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    error_line,
    jsonl,
    output_line,
    parse_batch_file,
)
from jobs.domain.service import JobService
from jobs.domain.settings import Settings

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

MODEL = "smollm2-135m"


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch):
    """The service's own checks of a line's parameters (known model, max_tokens within the context)."""
    monkeypatch.setenv("FREIGHT_MODELS", json.dumps([MODEL, "other-model"]))
    monkeypatch.setenv("FREIGHT_MAX_MODEL_LEN", "512")
    return JobService(Settings(), None, None, None).resolve


def chat_line(custom_id: str | None = "a", **body) -> dict:
    line = {
        "method": "POST",
        "url": CHAT_ENDPOINT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body},
    }
    if custom_id is not None:
        line["custom_id"] = custom_id
    return line


def encode(*lines) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def only_error(parsed) -> str:
    assert len(parsed.errors) == 1, parsed.errors
    return parsed.errors[0].message


def test_good_lines_become_rows_in_line_order(check) -> None:
    data = encode(
        chat_line("x", max_tokens=8, temperature=0, seed=7),
        chat_line("y", max_completion_tokens=4, top_p=0.5, n=1, response_format={"type": "text"}),
    )
    parsed = parse_batch_file(data, CHAT_ENDPOINT, check)
    assert parsed.errors == [] and parsed.lines == 2 and parsed.model == MODEL
    table = pq.read_table(io.BytesIO(parsed.to_parquet())).to_pylist()
    assert [row["custom_id"] for row in table] == ["x", "y"]
    assert table[0]["messages"] == [{"role": "user", "content": "Hi"}]
    assert (table[0]["max_tokens"], table[0]["temperature"], table[0]["seed"]) == (8, 0.0, 7)
    assert (table[1]["max_tokens"], table[1]["top_p"], table[1]["temperature"]) == (4, 0.5, None)
    params = parsed.job_params(chat_max_tokens=511)
    assert (params.model, params.max_tokens, params.temperature) == (MODEL, 511, 1.0)


def test_completions_lines_hold_a_prompt(check) -> None:
    line = {
        "custom_id": "p",
        "method": "POST",
        "url": COMPLETIONS_ENDPOINT,
        "body": {"model": MODEL, "prompt": "Once"},
    }
    parsed = parse_batch_file(encode(line), COMPLETIONS_ENDPOINT, check)
    assert pq.read_table(io.BytesIO(parsed.to_parquet())).to_pylist()[0]["prompt"] == "Once"
    assert parsed.job_params(chat_max_tokens=511).max_tokens == 16  # OpenAI's completions default


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (b'{"custom_id": "b", "method": "POST",', "line 2: is not valid JSON"),
        (b"[1, 2]", "line 2: must be a JSON object"),
        (b"\xff\xfe", "line 2: is not UTF-8"),
        (chat_line(None), "line 2: custom_id is missing"),
        (chat_line(""), "line 2: custom_id must be a non-empty string"),
        ({**chat_line("b"), "method": "GET"}, 'line 2: method must be "POST"'),
        (
            {**chat_line("b"), "url": "/v1/embeddings"},
            "line 2: url '/v1/embeddings' is not the batch's endpoint",
        ),
        ({**chat_line("b"), "body": "hello"}, "line 2: body must be a JSON object, not a string"),
        ({**chat_line("b"), "body": [1]}, "line 2: body must be a JSON object, not an array"),
        ({**chat_line("b"), "extra": 1}, "line 2: unknown field 'extra'"),
        (chat_line("b", tools=[]), "line 2: body field 'tools' is not supported"),
        (chat_line("b", n=2), "line 2: n = 2 is not supported"),
        (chat_line("b", stream=True), "line 2: stream = True is not supported"),
        (
            chat_line("b", max_tokens=0),
            "line 2: body: max_tokens: Input should be greater than or equal to 1",
        ),
        (chat_line("b", max_tokens="8"), "line 2: body: max_tokens: Input should be a valid integer"),
        (
            chat_line("b", max_tokens=600),
            "line 2: body: max_tokens is 600; it must be below the model context",
        ),
        (chat_line("b", temperature=3), "line 2: body: temperature: Input should be less than or equal to 2"),
        (
            chat_line("b", max_tokens=4, max_completion_tokens=4),
            "line 2: send max_tokens or max_completion_tokens",
        ),
        (chat_line("b", model="gpt-4o"), "line 2: body: unknown model 'gpt-4o'"),
        (chat_line("b", messages=[]), "line 2: body.messages must be a non-empty array"),
        (chat_line("b", messages=[{"role": "tool", "content": "x"}]), "line 2: body.messages[0].role 'tool'"),
        (
            chat_line("b", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "line 2: body.messages[0].content: only text parts are supported",
        ),
        (
            chat_line("b", response_format={"type": "xml"}),
            "line 2: response_format.type must be text, json_object or json_schema",
        ),
        (
            chat_line("b", response_format={"type": "json_schema", "json_schema": {}}),
            "line 2: response_format.json_schema.name must be",
        ),
        (
            chat_line("b", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
            "line 2: response_format.json_schema.schema must be a JSON object",
        ),
        (chat_line("b", model="other-model"), "line 2: model 'other-model' differs from the batch's"),
        (chat_line("b", stop=["\n"]), "line 2: stop differs from the batch's"),
    ],
)
def test_a_bad_line_is_that_lines_error(check, bad, expected: str) -> None:
    data = encode(chat_line("a"), bad, chat_line("c"))
    parsed = parse_batch_file(data, CHAT_ENDPOINT, check)
    assert expected in only_error(parsed)
    assert parsed.errors[0].line == 2
    assert [request.custom_id for request in parsed.requests] == ["a", "c"]


def test_a_repeated_custom_id_is_the_later_lines_error(check) -> None:
    parsed = parse_batch_file(encode(chat_line("a"), chat_line("b"), chat_line("a")), CHAT_ENDPOINT, check)
    message = only_error(parsed)
    assert "line 3: custom_id 'a' is repeated (first on line 1)" in message
    assert parsed.errors[0].code == "duplicate_custom_id" and parsed.errors[0].custom_id == "a"
    assert [request.custom_id for request in parsed.requests] == ["a", "b"]


def test_blank_lines_are_skipped_but_counted_in_line_numbers(check) -> None:
    data = encode(chat_line("a")) + b"\n  \n" + encode({**chat_line("b"), "method": "PUT"})
    parsed = parse_batch_file(data, CHAT_ENDPOINT, check)
    assert parsed.lines == 2 and parsed.errors[0].line == 4


def test_every_line_bad_leaves_no_request_and_names_each_line(check) -> None:
    data = encode(b"not json", chat_line(None), {**chat_line("c"), "url": "/v1/completions"})
    parsed = parse_batch_file(data, CHAT_ENDPOINT, check)
    assert parsed.requests == []
    assert [error.line for error in parsed.errors] == [1, 2, 3]


def test_file_level_problems_raise() -> None:
    with pytest.raises(InputError, match="no requests"):
        parse_batch_file(b"\n\n", CHAT_ENDPOINT)
    with pytest.raises(InputError, match="endpoint must be one of"):
        parse_batch_file(encode(chat_line("a")), "/v1/embeddings")


def test_output_and_error_lines_have_the_openai_shape() -> None:
    """The lines as written to the files: each body parses as the `openai` SDK's own type."""
    lines = [
        output_line(
            batch_id="batch_" + "0" * 32,
            row_index=3,
            custom_id="q",
            endpoint=endpoint,
            model=MODEL,
            created=1,
            text="Hello",
            finish_reason="length",
            prompt_tokens=5,
            output_tokens=2,
        )
        for endpoint in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
    ]
    errors = (("7", "r", "batch_cancelled", None), ("line2", None, "x", 400))  # cancelled row, refused line
    lines += [
        error_line(batch_id="batch_" + "0" * 32, key=key, custom_id=custom_id, code=code, message="m",
                   status_code=status_code)
        for key, custom_id, code, status_code in errors
    ]  # fmt: skip
    chat, completion, cancelled, refused = (json.loads(text) for text in jsonl(lines).decode().splitlines())
    assert list(chat) == ["id", "custom_id", "response", "error"]
    assert chat["custom_id"] == "q" and chat["error"] is None and chat["response"]["status_code"] == 200
    body = SdkChatCompletion.model_validate(chat["response"]["body"])
    assert body.object == "chat.completion" and body.choices[0].message.content == "Hello"
    assert body.choices[0].finish_reason == "length" and body.usage.total_tokens == 7
    text = SdkCompletion.model_validate(completion["response"]["body"])
    assert text.object == "text_completion" and text.choices[0].text == "Hello"
    assert text.usage.prompt_tokens == 5
    assert cancelled["response"] is None and cancelled["error"] == {"code": "batch_cancelled", "message": "m"}
    assert refused["custom_id"] is None and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"] == {
        "message": "m", "type": "invalid_request_error", "param": None, "code": "x"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("job_status", "expired", "expected"),
    [
        (None, False, "failed"),
        ("validating", False, "validating"),
        ("queued", False, "in_progress"),
        ("in_progress", False, "in_progress"),
        ("finalizing", False, "finalizing"),
        ("completed", False, "completed"),
        ("failed", False, "failed"),
        ("cancelling", False, "cancelling"),
        ("cancelled", False, "cancelled"),
        ("cancelling", True, "finalizing"),
        ("finalizing", True, "finalizing"),
        ("cancelled", True, "expired"),
        ("completed", True, "expired"),
        ("failed", True, "failed"),
    ],
)
def test_the_batch_status_is_read_from_the_job(job_status, expired: bool, expected: str) -> None:
    from jobs.domain.batch_files import batch_status

    assert batch_status(job_status, expired) == expected


def test_response_format_becomes_the_rows_structured_columns(check) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    data = encode(
        chat_line("a"),
        chat_line("b", response_format={"type": "json_object"}),
        chat_line("c", response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}),
        chat_line("d", response_format={"type": "text"}),
    )
    parsed = parse_batch_file(data, CHAT_ENDPOINT, check)
    assert not parsed.errors
    table = pq.read_table(io.BytesIO(parsed.to_parquet()))
    assert table.column("json_schema").to_pylist() == [
        None, '{"type":"object"}', json.dumps(schema, separators=(",", ":")), None
    ]
    assert table.column("regex").null_count == 4 and table.column("choice").null_count == 4
