"""The input rules of issue 28, unit by unit (docs/input-rules.md): the text rule, bounded JSON parsing,
structural limits of constraints, the grammar check's budget, and the Parquet cells they apply to.
Property tests (hypothesis) generate each class of hostile input; the service tests
(tests/service/test_hostile_inputs_2.py) send the same classes through a real API."""

from __future__ import annotations

import io
import json
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.domain.constraint_limits import regex_problem, schema_problem
from jobs.domain.errors import InputError
from jobs.domain.grammar_check import GrammarChecker, SubmissionGrammar
from jobs.domain.json_limits import JsonLimits, JsonRefused, parse_json
from jobs.domain.openai_batch import CHAT_ENDPOINT, parse_batch_file
from jobs.domain.schemas import job_params
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from jobs.domain.structured_spec import StructuredSpec, from_params
from jobs.domain.text_rule import check_arrow_text, repaired, text_problem, tree_problem
from jobs.domain.validation import validate_parquet

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

LIMITS = JsonLimits()
FAST = settings(max_examples=60, deadline=None)

surrogates = st.integers(0xD800, 0xDFFF).map(chr)
clean_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=30)


@st.composite
def hostile_text(draw: st.DrawFn) -> str:
    """Text with one lone surrogate or NUL somewhere in it."""
    bad = draw(st.one_of(surrogates, st.just("\x00")))
    return draw(clean_text) + bad + draw(clean_text)


# ---- the text rule ----------------------------------------------------------------------------


@FAST
@given(hostile_text())
def test_the_text_rule_finds_every_surrogate_and_nul(value: str) -> None:
    problem = text_problem(value)
    assert problem is not None and ("lone surrogate" in problem or "NUL" in problem)
    assert repaired(value).encode("utf-8")  # a stored value always renders
    if "\x00" in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        assert text_problem(value, allow_nul=True) is None


@FAST
@given(clean_text)
def test_clean_text_passes(value: str) -> None:
    assert text_problem(value) is None and repaired(value) == value


@FAST
@given(
    st.recursive(
        clean_text | st.integers() | st.none(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(clean_text, inner, max_size=3),
        max_leaves=10,
    ),
    hostile_text(),
    st.booleans(),
)
def test_tree_problem_finds_a_bad_string_at_any_depth_key_or_value(tree, bad: str, as_key: bool) -> None:
    hostile = {bad: 1} if as_key else {"k": [bad]}
    assert tree_problem(tree) is None
    assert tree_problem({"inner": [tree, hostile]}, "params") is not None
    json.dumps(repaired({"inner": [tree, hostile]}), ensure_ascii=False).encode("utf-8")


def test_arrow_cells_invalid_utf8_and_nul_name_the_row() -> None:
    raw = pa.array([b"ok", b"ok", b"\xff\xfe"], pa.binary())
    invalid = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    with pytest.raises(InputError) as caught:
        check_arrow_text(invalid, "prompt", 10, allow_nul=True)
    assert caught.value.row == 12 and "not valid UTF-8" in caught.value.message
    nul = pa.array(["a", "b\x00"])
    check_arrow_text(nul, "prompt", 0, allow_nul=True)  # prompt text may hold NUL
    with pytest.raises(InputError, match="row 1: custom_id contains a NUL"):
        check_arrow_text(nul, "custom_id", 0, allow_nul=False)
    messages = pa.array([[{"role": "user", "content": "fine"}], [{"role": "user", "content": "x"}]])
    check_arrow_text(messages, "messages", 0, allow_nul=True)


# ---- bounded JSON -----------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(10**30), 10**30) | clean_text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(clean_text, inner, max_size=4),
    max_leaves=20,
)


@FAST
@given(json_values)
def test_what_is_within_the_limits_parses_as_json_does(value) -> None:
    raw = json.dumps(value)
    assert parse_json(raw, "params", LIMITS) == json.loads(raw)


@FAST
@given(st.integers(LIMITS.max_depth + 1, 20_000), st.sampled_from(["[", '{"a":']))
def test_any_nesting_over_the_limit_is_refused_naming_max_depth(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    raw = opener * depth + "1" + closer * depth
    with pytest.raises(JsonRefused) as caught:
        parse_json(raw, "params", LIMITS)
    assert caught.value.limit == "max_depth" and f"{depth} deep" in caught.value.message


@FAST
@given(st.integers(LIMITS.max_number_chars + 1, 6000), st.sampled_from(["", "-"]), st.sampled_from(["", ".5", "e7"]))
def test_any_huge_number_is_refused_before_conversion(digits: int, sign: str, tail: str) -> None:
    raw = '{"seed": ' + sign + "9" * digits + tail + "}"
    with pytest.raises(JsonRefused) as caught:
        parse_json(raw, "params", LIMITS)
    assert caught.value.limit == "max_number_chars"


@FAST
@given(st.dictionaries(clean_text, json_scalars, min_size=1, max_size=5), st.data())
def test_a_repeated_key_at_any_level_is_refused(obj: dict, data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(obj)))
    body = json.dumps(obj)[:-1] + f", {json.dumps(key)}: 1}}"
    nested = data.draw(st.booleans())
    raw = '{"outer": [' + body + "]}" if nested else body
    with pytest.raises(JsonRefused) as caught:
        parse_json(raw, "params", LIMITS)
    assert caught.value.limit == "duplicate_key"


def test_keys_size_and_brackets_inside_strings() -> None:
    with pytest.raises(JsonRefused, match="max_keys"):
        parse_json(json.dumps({f"k{i}": i for i in range(20)}), "body", JsonLimits(max_keys=10))
    with pytest.raises(JsonRefused, match="max_bytes"):
        parse_json(" " * 100, "body", JsonLimits(max_bytes=10))
    assert parse_json('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"]"}', "b", LIMITS)["a"].startswith("[[")
    with pytest.raises(JsonRefused, match="lone surrogate"):
        parse_json('{"metadata": {"k": "\\ud800"}}', "params", LIMITS)
    assert parse_json('"\\ud83d\\ude00"', "params", LIMITS) == "\U0001f600"  # a pair is one character


def test_settings_hold_the_one_limits_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREIGHT_JSON_LIMITS", '{"max_depth": 5}')
    assert Settings().json_limits.max_depth == 5
    assert Settings().json_limits.max_keys == JsonLimits().max_keys


# ---- constraint structure ---------------------------------------------------------------------

LOOKAROUND = st.sampled_from(["(?=", "(?!", "(?<=", "(?<!"])
regex_atoms = st.sampled_from(["a", "[0-9]", "\\d", "(x|y)", "\\(", "[(?=]", ".", "b+"])


@FAST
@given(st.lists(regex_atoms, max_size=6), LOOKAROUND, st.lists(regex_atoms, max_size=6))
def test_a_lookaround_is_refused_the_same_as_regex_and_as_schema_pattern(before, opener, after) -> None:
    pattern = "".join(before) + opener + "a)" + "".join(after)
    as_regex = regex_problem(pattern)
    assert as_regex is not None and "look" in as_regex
    with pytest.raises(ValueError, match="look"):
        from_params(regex=pattern)
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ValueError, match="look"):
        from_params(json_schema=schema)
    assert "look" in schema_problem(schema)


@FAST
@given(st.lists(regex_atoms, max_size=8))
def test_regexes_without_lookaround_pass_the_structure_check(atoms) -> None:
    assert regex_problem("".join(atoms)) is None


@FAST
@given(st.integers(25, 600))
def test_deep_schemas_are_refused_before_compilation(depth: int) -> None:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="deep"):
        from_params(json_schema=json.dumps(schema))  # as a string
    with pytest.raises(ValueError, match="deep"):
        from_params(json_schema=schema)  # as an object


def test_other_structural_limits() -> None:
    assert "repeats" in regex_problem("a{100000}")
    assert "groups" in regex_problem("(" * 40 + "a" + ")" * 40)
    assert "maxLength" in schema_problem({"type": "string", "maxLength": 10**9})
    assert regex_problem(r"\(?=a\)") is None  # escaped: plain characters


# ---- the grammar check's budget ---------------------------------------------------------------

# A stand-in for `freight-grammar-check`: "slow" constraints take 30 s, regexes with
# "bad" are refused, and every request it gets is appended to a log, so a test can count compilations.
FAKE_CHILD = textwrap.dedent(
    """
    import json, sys, time
    log = open(sys.argv[1], "a")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        log.write(line); log.flush()
        value = json.dumps(request.get("value"))
        if "slow" in value:
            time.sleep(30)
        refusal = "regex refused by the grammar engine: bad" if "bad" in value else None
        print(json.dumps({"refusal": refusal}), flush=True)
    """
)


@pytest.fixture
def fake_checker(tmp_path: Path):
    log = tmp_path / "asked.jsonl"
    log.touch()
    checker = GrammarChecker(command=[sys.executable, "-c", FAKE_CHILD, str(log)])
    yield checker, log
    checker.close()


def asked(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_over_budget_is_a_refusal_never_an_acceptance(fake_checker) -> None:
    checker, _log = fake_checker
    grammar = SubmissionGrammar(checker, budget_s=1.0)
    started = time.monotonic()
    refusal = grammar(StructuredSpec(kind="regex", value="slow"))
    assert refusal is not None and "time budget" in refusal
    # the budget is spent: the next constraint of this submission is refused without asking
    assert "time budget" in grammar(StructuredSpec(kind="regex", value="[a-z]"))
    assert time.monotonic() - started < 5
    # the stuck child was replaced at once: a new submission gets answers within its own budget
    fresh = SubmissionGrammar(checker, budget_s=10.0)
    assert fresh(StructuredSpec(kind="regex", value="[a-z]")) is None
    # and the slow constraint, once over the whole budget, is refused from the cache at once
    started = time.monotonic()
    assert "time budget" in SubmissionGrammar(checker, budget_s=1.0)(StructuredSpec(kind="regex", value="slow"))
    assert time.monotonic() - started < 0.5


def test_each_distinct_constraint_is_compiled_once_per_submission(fake_checker) -> None:
    checker, log = fake_checker
    grammar = SubmissionGrammar(checker, budget_s=10.0)
    schema = StructuredSpec(kind="json_schema", value='{"type":"string","pattern":"p[0-9]"}')
    for _ in range(5):
        assert grammar(schema) is None
        assert grammar(StructuredSpec(kind="regex", value="p[0-9]")) is None  # the same as the pattern
    assert grammar.compiled == 2
    assert [(a["kind"], a["value"]) for a in asked(log)] == [("regex", "p[0-9]"), ("json_schema", schema.value)]


def test_a_pattern_is_refused_exactly_when_the_bare_regex_is(fake_checker) -> None:
    checker, _log = fake_checker
    grammar = SubmissionGrammar(checker, budget_s=10.0)
    schema = StructuredSpec(kind="json_schema", value='{"type":"string","pattern":"bad"}')
    as_pattern = grammar(schema)
    as_regex = grammar(StructuredSpec(kind="regex", value="bad"))
    assert as_regex is not None and as_pattern is not None and as_regex in as_pattern


def write_parquet(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def test_three_slow_rows_cost_one_budget_not_three(fake_checker, tmp_path: Path) -> None:
    checker, log = fake_checker
    source = write_parquet(
        tmp_path / "in.parquet",
        pa.table({"prompt": ["a", "b", "c"], "regex": ["slow1", "slow2", "slow3"]}),
    )
    service = JobService(Settings(grammar_budget_seconds=1.5), None, None, None, grammar=checker)
    resolved = service.resolve(job_params({"max_tokens": 4}))
    started = time.monotonic()
    with pytest.raises(InputError) as caught:
        validate_parquet(source, resolved, 2048, service.grammar_session())
    assert time.monotonic() - started < 4
    assert caught.value.status_code == 422 and caught.value.row == 0 and "time budget" in caught.value.message
    assert len(asked(log)) == 1


def test_an_openai_line_is_checked_once_for_its_line_and_its_row(fake_checker) -> None:
    checker, log = fake_checker
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "q+"}}}
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": CHAT_ENDPOINT,
        "body": {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        },
    }
    grammar = SubmissionGrammar(checker, budget_s=10.0)
    parsed = parse_batch_file(json.dumps(line).encode(), CHAT_ENDPOINT, None, grammar)
    assert not parsed.errors
    table = pq.read_table(io.BytesIO(parsed.to_parquet()))
    for value in table.column("json_schema").to_pylist():  # what validate_parquet asks for the row
        grammar(StructuredSpec(kind="json_schema", value=value))
    assert grammar.compiled == 2  # the pattern and the schema, once each


# ---- Parquet cells ----------------------------------------------------------------------------


def resolved(**params):
    return JobService(Settings(), None, None, None).resolve(job_params({"max_tokens": 4, **params}))


def test_dictionary_encoded_string_columns_are_ordinary(tmp_path: Path) -> None:
    table = pa.table({
        "prompt": pa.array(["a", "b", "a"]).dictionary_encode(),
        "custom_id": pa.array(["x", "y", "z"]).dictionary_encode(),
        "text": pa.array(["t", "u", "t"]).dictionary_encode(),
    })  # fmt: skip
    source = write_parquet(tmp_path / "dict.parquet", table)
    assert pq.read_schema(source).field("prompt").type == pa.dictionary(pa.int32(), pa.string())
    assert validate_parquet(source, resolved(), 2048).num_rows == 3
    assert validate_parquet(source, resolved(template="Say {text}"), 2048).num_rows == 3
    dupes = write_parquet(tmp_path / "dupes.parquet", table.set_column(1, "custom_id", pa.array(["x", "x", "z"]).dictionary_encode()))
    with pytest.raises(InputError, match="custom_id must be unique"):
        validate_parquet(dupes, resolved(), 2048)


@pytest.mark.parametrize(
    ("values", "kind"),
    [([1, -5], pa.int64()), ([2**64 - 1], pa.uint64()), ([2**63], pa.uint64())],
    ids=["-5", "2^64-1", "2^63"],
)
def test_seed_column_out_of_range_is_refused(tmp_path: Path, values: list[int], kind: pa.DataType) -> None:
    source = write_parquet(tmp_path / "seed.parquet", pa.table({"prompt": ["a"] * len(values), "seed": pa.array(values, kind)}))
    with pytest.raises(InputError) as caught:
        validate_parquet(source, resolved(), 2048)
    assert caught.value.column == "seed" and "between 0 and 9223372036854775807" in caught.value.message


@pytest.mark.parametrize("column", ["prompt", "custom_id", "text", "regex"])
def test_invalid_utf8_in_any_read_string_column_is_a_422_naming_it(tmp_path: Path, column: str) -> None:
    raw = pa.array([b"fine", b"bad \xff"], pa.binary())
    invalid = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    columns = {"prompt": pa.array(["a", "b"]), "text": pa.array(["c", "d"])}
    columns[column] = invalid
    source = write_parquet(tmp_path / "bad.parquet", pa.table(columns))
    params = {"template": "Say {text}"} if column == "text" else {}
    with pytest.raises(InputError) as caught:
        validate_parquet(source, resolved(**params), 2048)
    assert caught.value.row == 1 and caught.value.column == column and "UTF-8" in caught.value.message
