"""Prompt preparation: build each row's prompt from the job's source (template, column or chat),
tokenize in batches, apply the truncate option (worker/engine/prompt_ids.py), and turn rows without a usable prompt into error
records. Each kind turns the token ids into its engine requests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.domain.prompts import Messages, PromptSource
from jobs.domain.schemas import ResolvedParams
from storage.result_record import ResultRecord
from worker.engine import LLM
from worker.engine.prompt_ids import prompt_token_ids, runnable, truncate_budget
from worker.shard.requests import custom_id


@dataclass(frozen=True)
class PreparedPrompt:
    row_index: int
    record: dict[str, Any]  # the input row (prompt columns, override columns, custom_id)
    prompt_ids: list[int]


def error_record(index: int, record: dict[str, Any], problem: str) -> ResultRecord:
    return ResultRecord.failed(index, custom_id(index, record), problem)


def prepare_prompts(
    llm: LLM,
    source: PromptSource,
    params: ResolvedParams,
    records: dict[int, dict[str, Any]],
    on_error: Callable[[ResultRecord], None],
) -> list[PreparedPrompt]:
    """Token ids of each row's prompt (worker/engine/prompt_ids.py: the rule the API's exact quote counts
    by too); rows without a usable prompt go to `on_error` right away."""
    built: list[tuple[int, str | Messages]] = []
    for index, record in records.items():
        prompt, problem = source.build(record)
        if prompt is None:
            on_error(error_record(index, record, problem))
            continue
        built.append((index, prompt))
    # Chat prompts first (the engine's stream orders requests by length; equal lengths keep this order).
    built.sort(key=lambda entry: not isinstance(entry[1], list))
    max_len = llm.max_model_len
    budgets = [
        truncate_budget(max_len, int(records[index].get("max_tokens") or params.max_tokens))
        if params.truncate
        else None
        for index, _prompt in built
    ]
    encoded = prompt_token_ids(llm.tokenizer, [prompt for _, prompt in built], max_model_len=max_len, budgets=budgets)
    prepared: list[PreparedPrompt] = []
    for (index, _prompt), ids in zip(built, encoded, strict=True):
        record = records[index]
        if not runnable(ids, max_len):
            problem = (
                f"prompt has {len(ids)} tokens; the model's context is {max_len} tokens "
                "and at least one must be left for output"
            )
            on_error(error_record(index, record, problem))
            continue
        prepared.append(PreparedPrompt(index, record, ids))
    return prepared
