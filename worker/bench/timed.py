"""One timed `generate` and the engine counters it spent: what the scripts/*_bench.py comparisons share."""

from __future__ import annotations

import time
from dataclasses import dataclass

from worker.engine import LLM, SamplingParams
from worker.engine.outputs import RequestOutput


@dataclass
class TimedRun:
    outputs: list[RequestOutput]
    seconds: float
    spent: dict[str, float]  # EngineStats counters (prompt_tokens, output_tokens, ...) spent by the run

    @property
    def tokens_per_s(self) -> float:
        return (self.spent["prompt_tokens"] + self.spent["output_tokens"]) / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.spent["output_tokens"] / self.seconds


def timed_generate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> TimedRun:
    before = llm.stats.as_dict()
    started = time.perf_counter()
    outputs = llm.generate(batch, params)
    seconds = time.perf_counter() - started
    after = llm.stats.as_dict()
    spent = {name: after[name] - before[name] for name, value in after.items() if isinstance(value, int | float)}
    return TimedRun(outputs, seconds, spent)
