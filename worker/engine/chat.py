"""Chat messages to a prompt string through the tokenizer's own chat template."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template; send plain prompts instead of messages")
    if not messages:
        raise ValueError("messages is empty")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"each message needs 'role' and 'content', got {message!r}")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
