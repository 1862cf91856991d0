"""What the engine hands back: one RequestOutput per request, EngineStats per engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "error"]


@dataclass
class RequestTimings:
    queued: float  # time.monotonic() when the request entered the engine
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    index: int  # position in the input list
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None = None
    logprobs: list[float] | None = None  # one per output token, when asked for
    prompt_logprobs: list[float] | None = None  # one per prompt token after the first
    timings: RequestTimings | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    computed_tokens: int = 0  # tokens whose KV the model computed, recompute after preemption included
    # tokens whose KV came from the prefix cache instead of the model (a sequence resumed after
    # preemption counts what it finds again, its own earlier output included)
    cached_prompt_tokens: int = 0
    # prompt-lookup speculation: draft tokens fed to the model, and those it agreed with (emitted without a
    # step of their own); rejected ones (the difference) ran through the model too but left no KV, so
    # computed_tokens does not count them
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    padding_tokens: int = 0
    num_kv_blocks: int = 0
    peak_kv_blocks_used: int = 0
    preemptions: int = 0
    batch_size_sum: int = 0  # running sequences summed over steps (for the mean)
    busy_seconds: float = 0.0
    timeline: list[dict[str, float]] = field(default_factory=list)  # bounded samples over time
    tier: str = ""  # CPU ISA tier (kernels/platform.py) or "cuda"
    paths: dict[str, str] = field(default_factory=dict)  # op -> path the engine runs (plan/execution_plan.py)
    parameters: int = 0  # the model's (parameters.py)
    active_parameters: int = 0  # those one token runs through (top-k experts of a MoE layer)

    @property
    def mean_running_batch_size(self) -> float:
        return self.batch_size_sum / self.steps if self.steps else 0.0

    @property
    def peak_kv_utilization(self) -> float:
        return self.peak_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

    def as_dict(self) -> dict[str, float | int | str | dict[str, str]]:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "computed_tokens": self.computed_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "padding_tokens": self.padding_tokens,
            "num_kv_blocks": self.num_kv_blocks,
            "peak_kv_blocks_used": self.peak_kv_blocks_used,
            "peak_kv_utilization": round(self.peak_kv_utilization, 4),
            "preemptions": self.preemptions,
            "mean_running_batch_size": round(self.mean_running_batch_size, 2),
            "busy_seconds": round(self.busy_seconds, 4),
            "tier": self.tier,
            "paths": dict(self.paths),
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
        }
