"""A quote's exact prompt tokens: every row's prompt built as the worker builds it (the job's prompt
source), tokenized by the API's `freight-grammar-check` child with the model's own tokenizer and the
worker's own rule (worker/engine/prompt_ids.py: chat template, special tokens, the truncate option), so
the quote counts the tokens the shards will run. The API itself has no tokenizer (it never imports torch).

Counting is unavailable where the grammar check is off (FREIGHT_GRAMMAR_CHECK=0) or cannot start, where
this host does not hold the model's files, for summarize jobs (their prompts are built as the map-reduce
runs), or past COUNT_BUDGET_S: the quote then estimates from characters and says so
(`prompt_tokens_exact: false`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import pyarrow.parquet as pq

from jobs.domain.schemas import ResolvedParams
from jobs.domain.validation import ValidatedInput

CHUNK_ROWS = 512  # prompts per request to the child: one answer stays well within its timeout
COUNT_BUDGET_S = 30.0  # all of one quote's counting; past it the quote estimates


class TokenCounter(Protocol):
    """jobs/domain/grammar_check.py GrammarChecker.count_tokens."""

    def count_tokens(self, request: dict, timeout: float) -> list[int | None] | None: ...


def exact_prompt_tokens(
    counter: TokenCounter | None,
    local: Path,
    validated: ValidatedInput,
    resolved: ResolvedParams,
    *,
    context_len: int,
    models_dir: Path,
) -> int | None:
    """The prompt tokens of the rows the engine will run (a row whose prompt does not fit is an error row,
    not run), or None when they cannot be counted here."""
    if counter is None or resolved.summarize is not None:
        return None
    source = validated.source
    columns = list(source.columns) + (["max_tokens"] if "max_tokens" in validated.override_columns else [])
    request = {
        "model": resolved.model,
        "models_dir": str(models_dir),
        "context_len": context_len,
        "truncate": resolved.truncate,
    }
    deadline = time.monotonic() + COUNT_BUDGET_S
    total = 0
    for batch in pq.ParquetFile(local).iter_batches(batch_size=CHUNK_ROWS, columns=list(dict.fromkeys(columns))):
        prompts = []
        for record in batch.to_pylist():
            prompt, _problem = source.build(record)
            if prompt is not None:  # a row without a prompt is an error row: nothing to count
                prompts.append([prompt, int(record.get("max_tokens") or resolved.max_tokens)])
        if not prompts:
            continue
        left = deadline - time.monotonic()
        counted = counter.count_tokens({**request, "prompts": prompts}, left) if left > 0 else None
        if counted is None or len(counted) != len(prompts):
            return None
        total += sum(count for count in counted if count is not None)
    return total
