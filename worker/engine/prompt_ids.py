"""A prompt's token ids as the engine runs them: the one rule of the worker's shards
(worker/shard/prompts.py) and of the API's exact quote (the token count of `freight-grammar-check`,
worker/engine/token_count.py), so the quote counts exactly the tokens a shard will run.

A chat prompt goes through the tokenizer's chat template, which holds its special tokens (none are added:
BOS would be doubled); a plain prompt gets the tokenizer's special tokens. The `truncate` job option cuts a
prompt longer than the model's context to leave room for the row's max_tokens: a plain prompt keeps its
first tokens; a chat prompt keeps its template whole (system text, roles, the assistant header the answer
follows) and loses the end of its longest message. A prompt that still does not fit is not run (the
worker makes it an error row)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.engine.chat import apply_chat_template

Messages = list[dict[str, str]]
# Re-tokenizing at the cut can merge or split a token or two; cut a little deeper than needed.
RETOKENIZE_MARGIN = 4


def truncate_budget(max_model_len: int, max_tokens: int) -> int:
    """The prompt tokens a truncated row keeps: the context less the row's max_tokens, at least one."""
    return max(1, max_model_len - max_tokens)


def runnable(ids: Sequence[int], max_model_len: int) -> bool:
    """Whether the engine runs a prompt of these ids: at least one token of the context is left for output."""
    return len(ids) < max_model_len


def prompt_token_ids(
    tokenizer: Any,  # a transformers tokenizer (the engine's own: LLM.tokenizer)
    prompts: Sequence[str | Messages],
    *,
    max_model_len: int,
    budgets: Sequence[int | None],
) -> list[list[int]]:
    """Each prompt's token ids, in order (tokenized in two batches: chat prompts, then plain ones). A
    prompt that does not fit (`runnable`) and has a budget (`truncate_budget`; None: no truncate option)
    is cut to it; one that still does not fit is returned whole, for the caller to refuse."""
    texts = [(apply_chat_template(tokenizer, p), False) if isinstance(p, list) else (p, True) for p in prompts]
    found: list[list[int]] = [[] for _ in prompts]
    for add_special in (False, True):
        group = [index for index, (_text, special) in enumerate(texts) if special == add_special]
        if not group:
            continue
        encoded = tokenizer([texts[index][0] for index in group], add_special_tokens=add_special)["input_ids"]
        for index, ids in zip(group, encoded, strict=True):
            budget = budgets[index]
            if not runnable(ids, max_model_len) and budget is not None:
                ids = truncated_ids(tokenizer, prompts[index], ids, budget) or ids
            found[index] = list(ids)
    return found


def truncated_ids(tokenizer: Any, prompt: str | Messages, ids: list[int], budget: int) -> list[int] | None:
    """Prompt token ids of at most `budget` tokens, or None when even an emptied message is too long."""
    if len(ids) <= budget:
        return ids
    if isinstance(prompt, str):
        return ids[:budget]
    messages = [dict(message) for message in prompt]
    for _ in range(len(messages) + 2):
        excess = len(ids) - budget
        if excess <= 0:
            return ids
        longest = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))
        content_ids = tokenizer.encode(messages[longest]["content"], add_special_tokens=False)
        if not content_ids:
            return None  # every message is empty and the template alone is over budget
        keep = max(0, len(content_ids) - excess - RETOKENIZE_MARGIN)
        messages[longest]["content"] = tokenizer.decode(content_ids[:keep])
        ids = tokenizer.encode(apply_chat_template(tokenizer, messages), add_special_tokens=False)
    return ids if len(ids) <= budget else None
