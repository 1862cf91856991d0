"""Prompt preparation: build each row's prompt from the job's source (template, column or chat),
tokenize in batches, apply the truncate option, and turn rows without a usable prompt into error
records. Each kind turns the token ids into its engine requests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.domain.prompts import PromptSource
from jobs.domain.schemas import ResolvedParams
from storage.result_record import ResultRecord
from worker.engine import LLM
from worker.shard.requests import custom_id
from worker.truncation import truncated_ids


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
    """Token ids of each row's prompt; rows without a usable prompt go to `on_error` right away."""
    texts: list[tuple[int, str, bool]] = []  # (row_index, text, add_special_tokens)
    prompts: dict[int, str | list] = {}  # kept for the truncate option
    for index, record in records.items():
        prompt, problem = source.build(record)
        if prompt is None:
            on_error(error_record(index, record, problem))
            continue
        prompts[index] = prompt
        if isinstance(prompt, list):
            # The chat template already holds the special tokens; adding BOS again would double it.
            texts.append((index, llm.apply_chat_template(prompt), False))
        else:
            texts.append((index, prompt, True))
    prepared: list[PreparedPrompt] = []
    for add_special in (False, True):
        group = [(index, text) for index, text, special in texts if special == add_special]
        if not group:
            continue
        encoded = llm.tokenizer([text for _, text in group], add_special_tokens=add_special)["input_ids"]
        for (index, _text), ids in zip(group, encoded, strict=True):
            record = records[index]
            if len(ids) >= llm.max_model_len and params.truncate:
                budget = llm.max_model_len - int(record.get("max_tokens") or params.max_tokens)
                ids = truncated_ids(llm, prompts[index], ids, max(1, budget)) or ids
            if len(ids) >= llm.max_model_len:
                problem = (
                    f"prompt has {len(ids)} tokens; the model's context is {llm.max_model_len} tokens "
                    "and at least one must be left for output"
                )
                on_error(error_record(index, record, problem))
                continue
            prepared.append(PreparedPrompt(index, record, ids))
    return prepared
