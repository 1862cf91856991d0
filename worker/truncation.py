"""The `truncate` job option: a prompt longer than the model's context is cut to fit, leaving room for
the row's max_tokens, instead of becoming an error row. A plain prompt keeps its first tokens; a chat
prompt keeps its template whole (system text, roles, the assistant header the answer follows) and
loses the end of its longest message."""

from __future__ import annotations

from typing import Any

from jobs.domain.prompts import Messages

# Re-tokenizing at the cut can merge or split a token or two; cut a little deeper than needed.
RETOKENIZE_MARGIN = 4


def truncated_ids(
    llm: Any,  # worker.engine.LLM: tokenizer and apply_chat_template
    prompt: str | Messages,
    ids: list[int],
    budget: int,
) -> list[int] | None:
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
        content_ids = llm.tokenizer.encode(messages[longest]["content"], add_special_tokens=False)
        if not content_ids:
            return None  # every message is empty and the template alone is over budget
        keep = max(0, len(content_ids) - excess - RETOKENIZE_MARGIN)
        messages[longest]["content"] = llm.tokenizer.decode(content_ids[:keep])
        ids = llm.tokenizer.encode(llm.apply_chat_template(messages), add_special_tokens=False)
    return ids if len(ids) <= budget else None
