"""Per-request sampling parameters (vLLM-style)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token (worker/engine/structured.py).

    json_schema: `value` is the schema (a dict, or its JSON text); json_object: any JSON object;
    regex: `value` is the pattern; choice: `value` is the list of allowed outputs. Equal constraints
    compare (and hash) equal, so an engine compiles each distinct one once.
    """

    kind: StructuredKind
    value: Any = None  # normalized: compact schema JSON text, pattern, or a tuple of choices

    def __post_init__(self) -> None:
        value = self.value
        if self.kind == "json_schema":
            # JSON text is kept as given: text the grammar engine cannot read fails its request there
            if not isinstance(value, str):
                if not isinstance(value, dict):
                    raise ValueError("json_schema must be a JSON object or its text")
                # compact text, property order kept (it is the order of the output's fields)
                value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        elif self.kind == "json_object":
            value = None
        elif self.kind == "regex":
            if not isinstance(value, str) or not value:
                raise ValueError("regex must be a non-empty string")
        elif self.kind == "choice":
            if isinstance(value, str) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            value = tuple(value)
        else:
            raise ValueError(f"unknown structured output kind {self.kind!r}")
        object.__setattr__(self, "value", value)

    @classmethod
    def json(cls, schema: dict | str) -> StructuredOutput:
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredOutput:
        return cls("choice", tuple(options))


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each sampled token
    prompt_logprobs: bool = False  # logprob of each prompt token after the first
    # constrained decoding (structured.py)
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.structured is not None and self.min_tokens:
            # the grammar decides where the output ends; a floor on its length could only break it
            raise ValueError("min_tokens cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
