"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from worker.engine.draft_state import DraftState
from worker.engine.outputs import FinishReason, RequestTimings
from worker.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: int
    index: int  # position in the caller's input list
    prompt_token_ids: list[int]
    params: SamplingParams
    timings: RequestTimings
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # per KV group (attention.kv_groups): the block of each block_size positions; in a window group the blocks
    # out of every future query's window are freed and their entries become block_manager.PLACEHOLDER
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash chain of its full blocks
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_text_end: int | None = None  # where the text is cut when a stop string matched
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None  # per-request RNG, so a seeded request samples alike in any batch
    draft_state: DraftState | None = None  # prompt-lookup drafting, made when the sequence first may draft

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table (the only one of a model without window layers)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Prompt (and any recomputed output) is cached; the next step feeds exactly one token."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) across prompt and output."""
        all_ids = self.prompt_token_ids + self.output_token_ids if end > self.num_prompt_tokens else self.prompt_token_ids
        return all_ids[start:end]
