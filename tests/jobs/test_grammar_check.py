"""The submission-time grammar check: a real child process running the engine's grammar construction, and
the service refusing a constraint the grammar engine refuses with a 4xx that names the row."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.errors import InputError
from jobs.domain.grammar_check import GrammarChecker
from jobs.domain.schemas import job_params
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from jobs.domain.structured_spec import StructuredSpec
from jobs.domain.validation import validate_parquet

SCHEMA = '{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}'


@pytest.fixture(scope="module")
def checker():
    checker = GrammarChecker()
    yield checker
    checker.close()


def test_accepts_what_the_engine_accepts_and_names_what_it_refuses(checker: GrammarChecker) -> None:
    assert checker.refusal(StructuredSpec(kind="json_schema", value=SCHEMA)) is None
    assert checker.refusal(StructuredSpec(kind="json_object")) is None
    assert checker.refusal(StructuredSpec(kind="regex", value="[0-9]{3}")) is None
    assert checker.refusal(StructuredSpec(kind="choice", value=["yes", "no"])) is None
    refused = checker.refusal(StructuredSpec(kind="json_schema", value='{"type":"no-such-type"}'))
    assert refused is not None and "refused by the grammar engine" in refused and "no-such-type" in refused
    lookbehind = checker.refusal(StructuredSpec(kind="regex", value="(?<=a)b"))
    assert lookbehind is not None and "ookbehind" in lookbehind


def test_answers_are_cached_and_a_dead_child_is_restarted(checker: GrammarChecker) -> None:
    spec = StructuredSpec(kind="regex", value="(?<=x)y")
    first = checker.refusal(spec)
    assert checker._active is not None
    checker._active.stop()  # the cached answer needs no process
    assert checker.refusal(spec) == first
    assert checker.refusal(StructuredSpec(kind="regex", value="[a-z]+")) is None  # a new child answers


def test_without_a_child_the_check_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    checker = GrammarChecker(command=["false"])
    with caplog.at_level(logging.WARNING):
        assert checker.refusal(StructuredSpec(kind="json_schema", value='{"type":"no-such-type"}')) is None
    assert "checked by the workers only" in caplog.text


def test_a_refused_row_schema_is_a_4xx_naming_the_row(checker: GrammarChecker, tmp_path: Path) -> None:
    source = tmp_path / "input.parquet"
    pq.write_table(
        pa.table({
            "prompt": ["a", "b", "c", "d"],
            "json_schema": [SCHEMA, None, SCHEMA, '{"type": "no-such-type"}'],
            "regex": [None, "[0-9]+", None, None],
        }),
        source,
    )  # fmt: skip
    service = JobService(Settings(), None, None, None, grammar=checker)
    resolved = service.resolve(job_params({"max_tokens": 16}))
    with pytest.raises(InputError) as caught:
        validate_parquet(source, resolved, 2048, checker.refusal)
    error = caught.value
    assert error.row == 3 and error.column == "json_schema" and error.status_code == 422
    assert "row 3" in error.message and "no-such-type" in error.message
    assert validate_parquet(source, resolved, 2048).num_rows == 4  # without the check: the worker's problem


def test_a_refused_job_schema_is_a_4xx_naming_the_field(checker: GrammarChecker) -> None:
    service = JobService(Settings(), None, None, None, grammar=checker)
    with pytest.raises(InputError) as caught:
        service.resolve(job_params({"max_tokens": 16, "regex": r"(a)\1"}))
    assert caught.value.field == "regex" and "Backreference" in caught.value.message
    assert service.resolve(job_params({"max_tokens": 16, "regex": "[ab]+"})).structured is not None
