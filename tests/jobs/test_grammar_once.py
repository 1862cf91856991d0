"""The submission-time grammar check (jobs/domain/grammar_check.py, issue 28):

- a check stopped for time does not make the next submission wait for a checker restart: a warm standby
  child takes over at once (the real `freight-grammar-check`, which imports torch and xgrammar);
- each constraint is compiled at most once per submission and once per API process, by its canonical form:
  the same JSON schema with another key order or other whitespace is one entry, and rows sharing a schema
  are checked once (a fake child logs what it is asked)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.grammar_check import START_TIMEOUT_S, GrammarChecker, SubmissionGrammar, canonical_key
from jobs.domain.schemas import job_params
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from jobs.domain.structured_spec import StructuredSpec, schema_text
from jobs.domain.validation import validate_parquet

# Within every structural limit, cheap as a bare regex, but many seconds for the engine inside a schema
# (each {0,1000} is expanded into the JSON string grammar): see tests/service/test_hostile_inputs_3.py.
SLOW_SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[a-z]{0,1000}" * 300}}}


def test_after_a_timeout_the_next_check_does_not_wait_for_a_restart() -> None:
    checker = GrammarChecker()
    try:
        assert checker.refusal(StructuredSpec(kind="regex", value="[0-9]+")) is None  # the first start
        assert checker.standby_ready(START_TIMEOUT_S), "the standby checker did not start"
        spawned = checker.spawned
        refusal = SubmissionGrammar(checker, budget_s=1.0)(
            StructuredSpec(kind="json_schema", value=json.dumps(SLOW_SCHEMA))
        )
        assert refusal is not None and "time budget" in refusal, refusal
        started = time.monotonic()
        assert SubmissionGrammar(checker, budget_s=10.0)(StructuredSpec(kind="regex", value="[a-z]{2,5}")) is None
        elapsed = time.monotonic() - started
        # A restart imports torch and xgrammar again (about 10 s on a busy 2-core runner).
        assert elapsed < 3.0, f"the next check took {elapsed:.1f} s"
        assert checker.spawned == spawned + 1  # the standby took over, and a new standby is starting
    finally:
        checker.close()


FAKE_CHILD = textwrap.dedent(
    """
    import json, sys
    log = open(sys.argv[1], "a")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        log.write(line); log.flush()
        print(json.dumps({"refusal": None}), flush=True)
    """
)


@pytest.fixture
def fake(tmp_path: Path):
    log = tmp_path / "asked.jsonl"
    log.touch()
    checker = GrammarChecker(command=[sys.executable, "-c", FAKE_CHILD, str(log)], standby=False)
    yield checker, log
    checker.close()


def asked(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


# One schema, four ways to write it (key order, whitespace), and the canonical form of all four.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}
WRITTEN = [
    json.dumps(SCHEMA),
    json.dumps(SCHEMA, separators=(",", ":")),
    json.dumps(SCHEMA, indent=2, sort_keys=True),
    '{ "required" : ["name"], "properties": {"age": {"type":"integer"}, "name": {"type": "string"}},\n "type":"object"}',
]


def test_one_schema_written_four_ways_has_one_canonical_key() -> None:
    keys = {canonical_key(StructuredSpec(kind="json_schema", value=text)) for text in WRITTEN}
    assert len(keys) == 1
    other = canonical_key(StructuredSpec(kind="json_schema", value=json.dumps({**SCHEMA, "required": ["age"]})))
    assert other not in keys  # a different schema stays different
    assert canonical_key(StructuredSpec(kind="regex", value="[a-z]")) != canonical_key(
        StructuredSpec(kind="regex", value="[a-y]")
    )


def test_a_schema_is_compiled_once_per_submission_and_per_process_however_written(fake) -> None:
    checker, log = fake
    grammar = SubmissionGrammar(checker, budget_s=10.0)
    for text in WRITTEN:
        assert grammar(StructuredSpec(kind="json_schema", value=schema_text(text))) is None
    assert grammar.compiled == 1 and len(asked(log)) == 1
    # Another submission of the same schema (another key order): answered from the process's cache.
    again = SubmissionGrammar(checker, budget_s=10.0)
    assert again(StructuredSpec(kind="json_schema", value=WRITTEN[3])) is None
    assert again.compiled == 1 and len(asked(log)) == 1
    # A different schema is asked.
    assert again(StructuredSpec(kind="json_schema", value=json.dumps({"type": "string"}))) is None
    assert len(asked(log)) == 2


def test_rows_sharing_a_schema_are_checked_once(fake, tmp_path: Path) -> None:
    checker, log = fake
    source = tmp_path / "input.parquet"
    schemas = [WRITTEN[i % len(WRITTEN)] for i in range(40)] + [None, json.dumps({"type": "boolean"})]
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(len(schemas))], "json_schema": schemas}), source)
    service = JobService(Settings(), None, None, None, grammar=checker)
    grammar = service.grammar_session()
    resolved = service.resolve(job_params({"max_tokens": 16}))
    assert validate_parquet(source, resolved, 2048, grammar).num_rows == len(schemas)
    assert grammar.compiled == 2  # SCHEMA (however written) and the boolean one
    assert sorted(json.loads(entry["value"])["type"] for entry in asked(log)) == ["boolean", "object"]
