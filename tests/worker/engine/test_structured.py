"""Structured output on a tiny random-weight Llama with the real SmolLM2 tokenizer.

Random weights make these strong tests: unconstrained, such a model never writes valid JSON, a regex
match or one of a few given strings; constrained, every output must be one.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from jobs.domain import structured_spec
from jobs.domain.schemas import job_params
from worker.engine import LLM, SamplingParams
from worker.engine.sampling_params import StructuredOutput
from worker.engine.structured import choice_grammar
from worker.shard.requests import engine_structured

# several typed fields; bounded (string lengths, integer range, list size) so that a random model,
# which would never close an open string of its own accord, still ends within max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "topic": {"type": "string", "enum": ["science", "history", "sport", "other"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "published": {"type": "boolean"},
    },
    "required": ["title", "year", "people", "topic", "published"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        quantization=None,
        kv_cache_dtype="auto",
        kv_cache_memory_gb=0.05,
    )
    llm.engine.speculator.min_ngram = 1  # a random model repeats only short phrases: let it draft from them
    return llm


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def parses_and_validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_schema_outputs_parse_and_validate(tiny: LLM) -> None:
    batch = prompts(12)
    plain = tiny.generate(batch, SamplingParams(max_tokens=160))
    outs = tiny.generate(batch, SamplingParams(max_tokens=160, structured=StructuredOutput.json(SCHEMA)))
    assert not any(parses_and_validates(o.text) for o in plain)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert parses_and_validates(out.text), out.text
        assert list(json.loads(out.text))[:4] == ["title", "year", "people", "topic"]  # the schema's order


def test_sampled_json_schema_outputs_validate(tiny: LLM) -> None:
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=i, structured=StructuredOutput.json(SCHEMA))
        for i in range(8)
    ]
    outs = tiny.generate(prompts(8, seed=1), params)
    assert all(o.finish_reason == "stop" and parses_and_validates(o.text) for o in outs), [
        o.text for o in outs
    ]
    assert len({o.text for o in outs}) > 1


def test_regex_and_choice(tiny: LLM) -> None:
    batch = prompts(8, seed=2)
    regex = tiny.generate(batch, SamplingParams(max_tokens=40, structured=StructuredOutput.regex(REGEX)))
    choice = tiny.generate(batch, SamplingParams(max_tokens=40, structured=StructuredOutput.choice(CHOICES)))
    plain = tiny.generate(batch, SamplingParams(max_tokens=40))
    assert not any(re.fullmatch(REGEX, o.text) or o.text in CHOICES for o in plain)
    for out in regex:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    for out in choice:
        assert out.finish_reason == "stop" and out.text in CHOICES, out.text


def test_choice_grammar_escapes_quotes_and_backslashes(tiny: LLM) -> None:
    options = ['say "hi"', "back\\slash", "naïve\nline"]
    assert choice_grammar(tuple(options)).startswith("root ::= ")
    outs = tiny.generate(
        prompts(6, seed=3), SamplingParams(max_tokens=30, structured=StructuredOutput.choice(options))
    )
    assert all(o.text in options for o in outs), [o.text for o in outs]


def test_json_object_gives_an_object(tiny: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any JSON object is unbounded (a random model never closes a string of its own accord): lean the
    model towards closing tokens; the grammar still decides which of them may come."""
    ids = tiny.tokenizer.convert_tokens_to_ids(['"', "}", "]", "1"]) + [
        tiny.engine.model_config.eos_token_ids[0]
    ]
    bias = torch.zeros(tiny.engine.model_config.vocab_size)
    bias[ids] = 6.0
    logits = tiny.engine.model.logits
    monkeypatch.setattr(tiny.engine.model, "logits", lambda hidden: logits(hidden) + bias)
    batch = prompts(8, seed=4)
    plain = tiny.generate(batch, SamplingParams(max_tokens=60))
    outs = tiny.generate(batch, SamplingParams(max_tokens=60, structured=StructuredOutput.json_object()))
    assert not any(_is_object(o.text) for o in plain)
    for out in outs:
        assert out.finish_reason == "stop" and _is_object(out.text), out.text


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_unconstrained_rows_are_unchanged_by_constrained_ones(tiny: LLM) -> None:
    batch = prompts(10, seed=5)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = tiny.generate(batch, plain)
    constrained = [
        StructuredOutput.json(SCHEMA),
        StructuredOutput.regex(REGEX),
        StructuredOutput.choice(CHOICES),
    ]
    mixed_params = [
        plain if i % 2 == 0 else SamplingParams(max_tokens=100, structured=constrained[i % 3])
        for i in range(10)
    ]
    mixed = tiny.generate(batch, mixed_params)
    for i in range(0, 10, 2):
        assert mixed[i].output_token_ids == alone[i].output_token_ids


def test_refused_schema_fails_its_row_only(tiny: LLM) -> None:
    bad = [
        StructuredOutput.json({"type": "no-such-type"}),
        StructuredOutput.json("{not json"),
        StructuredOutput.regex("(?<=a)b"),  # lookbehind: xgrammar has none
    ]
    params = [SamplingParams(max_tokens=60, structured=spec) for spec in bad]
    params += [
        SamplingParams(max_tokens=80, structured=StructuredOutput.json(SCHEMA)),
        SamplingParams(max_tokens=8),
    ]
    outs = tiny.generate(prompts(5, seed=6), params)
    for out in outs[:3]:
        assert out.finish_reason == "error" and out.output_token_ids == []
        assert out.error.startswith("structured output: ") and "refused by the grammar engine" in out.error
    assert "no-such-type" in outs[0].error
    assert "JSON" in outs[1].error
    assert "ookbehind" in outs[2].error
    assert outs[3].finish_reason == "stop" and parses_and_validates(outs[3].text)
    assert outs[4].finish_reason in ("stop", "length") and outs[4].error is None


def test_each_distinct_constraint_compiles_once(tiny: LLM) -> None:
    schema = {**SCHEMA, "title": "cache test"}  # a schema no other test compiled
    decoder = tiny.engine.structured
    before = decoder.compiles
    # equal constraints built separately share one compile
    params = [
        SamplingParams(max_tokens=100, structured=StructuredOutput.json(dict(schema))) for _ in range(16)
    ]
    tiny.generate(prompts(16, seed=7), params)
    assert decoder.compiles == before + 1
    tiny.generate(prompts(4, seed=8), params[:4])
    assert decoder.compiles == before + 1
    refused = [SamplingParams(max_tokens=8, structured=StructuredOutput.json({"type": "nope"}))] * 5
    tiny.generate(prompts(5), refused)
    tiny.generate(prompts(5), refused)
    assert decoder.compiles == before + 2


def test_structured_params() -> None:
    assert StructuredOutput.json({"b": 1, "a": 2}).value == '{"b":1,"a":2}'  # property order kept
    assert StructuredOutput.json({"a": 1}) == StructuredOutput.json({"a": 1})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=1, structured=StructuredOutput.json_object())
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput.choice([])


def test_json_rows_never_take_a_control_character(tiny: LLM) -> None:
    """xgrammar 0.2 lets a raw control character into a string with maxLength (invalid JSON); JSON rows
    mask every token holding a byte below 0x20, a regex row keeps them."""
    from worker.engine.sequence import Sequence

    decoder = tiny.engine.structured
    tok = tiny.tokenizer
    schema = {"type": "object", "properties": {"t": {"type": "string", "maxLength": 16}}, "required": ["t"]}
    json_seq = Sequence(0, 0, [5, 6], SamplingParams(max_tokens=30, structured=StructuredOutput.json(schema)), None)
    regex_seq = Sequence(1, 0, [5, 6], SamplingParams(max_tokens=30, structured=StructuredOutput.regex(".+")), None)
    for seq in (json_seq, regex_seq):
        assert decoder.attach(seq) is None
    for token in tok.encode('{"t": "a', add_special_tokens=False):  # xgrammar's compact form: ": "
        assert decoder.advance(json_seq, token) == (None, None)
    unit_separator = tok.encode("\x1f", add_special_tokens=False)[0]
    logits = torch.zeros(2, tiny.engine.model_config.vocab_size)
    decoder.apply_masks(logits, [json_seq, regex_seq], [[], []])
    assert not torch.isfinite(logits[0, unit_separator]) and torch.isfinite(logits[1, unit_separator])
    assert torch.isfinite(logits[0, tok.encode("b", add_special_tokens=False)[0]])


def test_speculative_draft_rows_are_masked_along_the_draft(tiny: LLM) -> None:
    """When a constrained sequence carries a draft, row j is masked after the draft's first j tokens and
    the matcher is back where it was."""
    from worker.engine.sequence import Sequence

    decoder = tiny.engine.structured
    seq = Sequence(
        0, 0, [5, 6], SamplingParams(max_tokens=30, structured=StructuredOutput.regex("ab+c")), None
    )
    assert decoder.attach(seq) is None
    tok = tiny.tokenizer
    a, b, c = (tok.convert_tokens_to_ids(x) for x in "abc")
    vocab = tiny.engine.model_config.vocab_size
    logits = torch.zeros(4, vocab)
    decoder.apply_masks(logits, [seq], [[a, b, c]])
    allowed = [set(torch.nonzero(row > float("-inf")).view(-1).tolist()) for row in logits]
    assert a in allowed[0] and b not in allowed[0]
    assert b in allowed[1] and c not in allowed[1]
    assert b in allowed[2] and c in allowed[2]
    assert c not in allowed[3] and b not in allowed[3]  # after "abc" only the stop token
    logits = torch.zeros(1, vocab)
    decoder.apply_masks(logits, [seq], [[]])  # rolled back: the first token is still "a"
    assert torch.isfinite(logits[0, a]) and not torch.isfinite(logits[0, b])


# -- the job domain (torch-free) and the shard's mapping ---------------------------------------------------


def test_openai_response_format() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA, "strict": True}}
    spec = structured_spec.from_response_format(rf)
    assert spec.kind == "json_schema" and json.loads(spec.value) == SCHEMA
    assert structured_spec.from_response_format({"type": "json_object"}).kind == "json_object"
    assert structured_spec.from_response_format({"type": "text"}) is None
    assert structured_spec.from_response_format(None) is None
    for bad, words in [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "strict"),
        ([1], "object"),
    ]:
        with pytest.raises(ValueError, match=words):
            structured_spec.from_response_format(bad)
    columns = structured_spec.as_columns(structured_spec.from_response_format({"type": "json_object"}))
    assert columns == {"json_schema": '{"type":"object"}', "regex": None, "choice": None}


def test_job_params_and_row_columns() -> None:
    params = job_params({"json_schema": SCHEMA})
    job_spec = params.structured()
    assert job_spec.kind == "json_schema" and json.loads(job_spec.value) == SCHEMA
    assert job_params({"json_schema": json.dumps(SCHEMA)}).structured() == job_spec
    assert job_params({"choice": ["a", "b"]}).structured().value == ["a", "b"]
    assert job_params({}).structured() is None
    for bad in [{"json_schema": "{oops"}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"regex": ""},
                {"json_schema": SCHEMA, "task": "summarize"}]:  # fmt: skip
        with pytest.raises(Exception, match="invalid params"):
            job_params(bad)
    # a row's non-null column wins over the job's constraint
    assert structured_spec.for_row(job_spec, {"regex": None}) == job_spec
    assert structured_spec.for_row(job_spec, {"regex": "x+"}).kind == "regex"
    assert structured_spec.for_row(None, {"choice": ["p", "q"]}).value == ["p", "q"]
    # and the shard hands the engine its form
    assert engine_structured(
        structured_spec.for_row(None, {"choice": ["p", "q"]})
    ) == StructuredOutput.choice(["p", "q"])
    assert engine_structured(job_spec) == StructuredOutput.json(SCHEMA)
    assert engine_structured(None) is None


def test_row_columns_are_checked_at_submission() -> None:
    import pyarrow as pa

    from jobs.domain.errors import InputError

    table = pa.table(
        {
            "prompt": ["a", "b", "c"],
            "json_schema": [json.dumps(SCHEMA), None, "{broken"],
            "choice": [None, ["x", "y"], None],
        }
    )
    names = structured_spec.check_column_types(table.schema)
    assert names == ("json_schema", "choice")
    with pytest.raises(InputError, match="row 12: json_schema is not valid JSON") as caught:
        structured_spec.check_column_values(table.to_batches()[0], names, offset=10)
    assert caught.value.row == 12
    both = pa.table({"regex": ["a+"], "choice": [["x"]]})
    with pytest.raises(InputError, match="row 0: set at most one"):
        structured_spec.check_column_values(both.to_batches()[0], ("regex", "choice"), offset=0)
    with pytest.raises(InputError, match="column 'regex' has type int64"):
        structured_spec.check_column_types(pa.table({"regex": [1]}).schema)
    with pytest.raises(InputError, match="list of strings"):
        structured_spec.check_column_types(pa.table({"choice": ["x"]}).schema)


def test_a_job_constrains_its_rows_through_the_shard(
    tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory, tmp_path
) -> None:
    """The job's json_schema for every row, a row's regex / choice / json_schema column instead; a schema
    the grammar engine refuses fails its row alone; a malformed column is refused at submission."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.domain.errors import InputError
    from jobs.domain.service import JobService
    from storage.blobs import results_name
    from storage.db import upgrade
    from storage.status import JobStatus, ShardStatus
    from tests.worker.contexts import worker_context
    from worker.finalize import finalize_job
    from worker.llm_pool import LLMPool
    from worker.shard.executor import run_shard

    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'freight.db'}"
    upgrade(url)
    params = job_params({"model": str(tiny_llama_dir), "max_tokens": 160, "json_schema": SCHEMA})
    source = tmp_path / "input.parquet"
    pq.write_table(
        pa.table({
            "prompt": ["Extract the fields.", "A code:", "Yes or no?", "Broken schema", "Another one."],
            "regex": [None, "[0-9]{3}", None, None, None],
            "choice": pa.array([None, None, ["yes", "no"], None, None], pa.list_(pa.string())),
            "json_schema": [None, None, None, '{"type": "no-such-type"}', None],
        }),
        source,
    )  # fmt: skip
    with worker_context(url, tmp_path_factory) as ctx:
        service = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)
        with open(source, "rb") as upload:
            job_id = service.submit("structured-tests", upload, params).id
        outcome = run_shard(ctx, LLMPool(ctx.settings), job_id, 0)
        assert outcome.status == ShardStatus.DONE
        assert finalize_job(ctx, job_id) == JobStatus.COMPLETED
        rows = pq.read_table(ctx.blobs.path(results_name(job_id))).to_pylist()
        assert parses_and_validates(rows[0]["output_text"]) and parses_and_validates(rows[4]["output_text"])
        assert re.fullmatch("[0-9]{3}", rows[1]["output_text"])
        assert rows[2]["output_text"] in ("yes", "no")
        assert rows[3]["finish_reason"] == "error" and "no-such-type" in rows[3]["error"]
        assert all(rows[i]["finish_reason"] == "stop" for i in (0, 1, 2, 4))

        both = tmp_path / "both.parquet"
        pq.write_table(pa.table({"prompt": ["a", "b"], "regex": [None, "x+"], "choice": [None, ["y"]]}), both)
        with open(both, "rb") as upload, pytest.raises(InputError, match="row 1: set at most one") as caught:
            service.submit("structured-tests", upload, params)
        assert caught.value.row == 1


def test_constrained_greedy_tokens_are_the_same_with_drafts_verified(tiny: LLM, tiny_llama_dir) -> None:
    """A constrained sequence that carries a draft has its rows are masked along the draft: the greedy
    tokens equal those of an engine that never speculates."""
    batch = prompts(4, seed=9)
    params = [
        SamplingParams(max_tokens=120, structured=spec)
        for spec in (
            StructuredOutput.json(SCHEMA),
            StructuredOutput.regex(REGEX),
            StructuredOutput.json_object(),
        )
    ] + [SamplingParams(max_tokens=40, ignore_eos=True)]
    plain = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        quantization=None,
        kv_cache_dtype="auto",
        kv_cache_memory_gb=0.05,
        enable_speculation=False,
    )
    expected = [o.output_token_ids for o in plain.generate(batch, params)]
    drafts_before = tiny.stats.draft_tokens
    assert [o.output_token_ids for o in tiny.generate(batch, params)] == expected
    assert tiny.stats.draft_tokens > drafts_before, "constrained sequences were meant to speculate"
