"""A quote's exact prompt tokens (jobs/domain/prompt_tokens.py): counted by the API's real
`freight-grammar-check` child with SmolLM2's real tokenizer, they equal the tokens the engine's own shard
preparation (worker/shard/prompts.py on a loaded LLM) gives the same rows: plain prompts (BOS added),
templates, the chat template, a messages column, the truncate option, rows too long to run and rows with
no prompt. Where the child cannot count, the quote falls back to its estimate."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.grammar_check import GrammarChecker
from jobs.domain.prompt_tokens import exact_prompt_tokens
from jobs.domain.schemas import job_params
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from jobs.domain.validation import validate_parquet
from storage.arrow_path import ArrowPath
from worker.engine import LLM
from worker.shard.prompts import prepare_prompts

CONTEXT = 96  # small, so that long rows need the truncate option (or are not run)
LONG = "The quick brown fox jumps over the lazy dog. " * 30  # about 300 tokens
TEXTS = ["Hello there!", "  leading spaces and ünïcödé ✓ 你好", LONG, "", None, "Tell me a joke.\n\nNow.", LONG[:200]]
MESSAGES = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": LONG}],
    [{"role": "user", "content": ""}],
    None,
    [{"role": "user", "content": "Two"}, {"role": "assistant", "content": "Yes?"}, {"role": "user", "content": "é"}],
]


@pytest.fixture(scope="module")
def checker():
    checker = GrammarChecker(standby=False)
    yield checker
    checker.close()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    """The engine on a model with SmolLM2's tokenizer; its own prompt preparation is the reference."""
    engine = LLM(str(tiny_llama_dir), max_model_len=CONTEXT, dtype="float32", quantization=None, kv_cache_dtype="auto")
    assert engine.max_model_len == CONTEXT
    return engine


CASES = {
    "plain": (pa.table({"prompt": TEXTS}), {}),
    "plain_truncated": (pa.table({"prompt": TEXTS, "max_tokens": [5, 8, 40, 3, 4, 9, None]}), {"truncate": True}),
    "template_chat": (
        pa.table({"text": TEXTS, "n": list(range(len(TEXTS)))}),
        {"template": "Item {n}: summarize.\n\n{text}", "chat": True, "truncate": True},
    ),
    "messages": (pa.table({"messages": MESSAGES}), {}),
    "messages_truncated": (pa.table({"messages": MESSAGES}), {"truncate": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_tokens_equal_the_engines_own(
    case: str, checker: GrammarChecker, llm: LLM, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    table, extra = CASES[case]
    source = tmp_path / "input.parquet"
    pq.write_table(table, source)
    service = JobService(Settings(), None, None, None, allow_any_model=True, grammar=checker)
    resolved = service.resolve(job_params({"model": str(tiny_llama_dir), "max_tokens": 16, **extra}))
    validated = validate_parquet(ArrowPath.local(source), resolved, CONTEXT)

    counted = exact_prompt_tokens(
        checker, source, validated, resolved, context_len=CONTEXT, models_dir=tmp_path / "no-models"
    )

    records = dict(enumerate(table.to_pylist()))
    errors = []
    prepared = prepare_prompts(llm, validated.source, resolved, records, errors.append)
    assert counted == sum(len(row.prompt_ids) for row in prepared)
    assert prepared and counted > 0
    if case == "plain":  # the long rows are not run without the truncate option; nor the empty ones
        assert len(errors) == 3 and all(len(row.prompt_ids) < CONTEXT for row in prepared)
    if extra.get("truncate"):  # the long rows ran cut, not as errors
        assert any(len(row.prompt_ids) >= 40 for row in prepared)


def test_an_alias_is_counted_from_the_model_cache(
    checker: GrammarChecker, smollm2_path: Path, llm: LLM, tmp_path: Path
) -> None:
    """The service quotes models by alias: the child finds the pulled model where the workers keep it
    (FREIGHT_HOME/models), and counts with its tokenizer (the same SmolLM2 tokenizer as `llm`'s)."""
    source = tmp_path / "input.parquet"
    pq.write_table(pa.table({"prompt": TEXTS}), source)
    service = JobService(Settings(), None, None, None, allow_any_model=True, grammar=checker)
    resolved = service.resolve(job_params({"model": "smollm2-135m", "max_tokens": 16, "chat": True}))
    validated = validate_parquet(ArrowPath.local(source), resolved, CONTEXT)
    counted = exact_prompt_tokens(
        checker, source, validated, resolved, context_len=CONTEXT, models_dir=smollm2_path.parent
    )
    records = dict(enumerate(pa.table({"prompt": TEXTS}).to_pylist()))
    prepared = prepare_prompts(llm, validated.source, resolved, records, lambda _row: None)
    assert counted == sum(len(row.prompt_ids) for row in prepared) > 0
    # Not on this host (an empty cache): no count, and the quote estimates instead.
    missing = exact_prompt_tokens(checker, source, validated, resolved, context_len=CONTEXT, models_dir=tmp_path)
    assert missing is None


def test_without_a_child_there_is_no_count(tiny_llama_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "input.parquet"
    pq.write_table(pa.table({"prompt": ["a b c"]}), source)
    service = JobService(Settings(), None, None, None, allow_any_model=True)
    resolved = service.resolve(job_params({"model": str(tiny_llama_dir), "max_tokens": 4}))
    validated = validate_parquet(ArrowPath.local(source), resolved, CONTEXT)
    dead = GrammarChecker(command=["false"], standby=False)
    assert exact_prompt_tokens(dead, source, validated, resolved, context_len=CONTEXT, models_dir=tmp_path) is None
    assert exact_prompt_tokens(None, source, validated, resolved, context_len=CONTEXT, models_dir=tmp_path) is None
