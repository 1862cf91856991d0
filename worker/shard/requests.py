"""What every kind of shard sends to the engine: requests with their sampling (one mapping from the
job's parameters and the row's override columns), run through one stream loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from jobs.domain.schemas import ResolvedParams
from jobs.domain.structured_spec import StructuredSpec, for_row
from worker.engine import LLM, SamplingParams
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import StructuredOutput

Tag = TypeVar("Tag")


@dataclass(frozen=True)
class EngineRequest(Generic[Tag]):
    row_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    tag: Tag  # what the kind needs to place the output (a custom_id, a summary request)


def custom_id(index: int, record: dict[str, Any]) -> str:
    """The row's custom_id column, or its row index when the input has none."""
    value = record.get("custom_id")
    return str(index) if value is None else value


def sampling_for(
    params: ResolvedParams,
    record: dict[str, Any],
    row_index: int,
    *,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None = None,
    seed_offset: int = 0,
) -> SamplingParams:
    """The one sampling mapping. The row's override columns (max_tokens, temperature, top_p, seed) win
    over the job's parameters. `max_tokens` is the request's own limit where the kind sets one (a
    summary's partial parts); otherwise the row's, else the job's. Without a row seed a seeded job
    gives each row its own (seed + row_index); `seed_offset` tells apart a row's several requests."""
    if max_tokens is None:
        max_tokens = record.get("max_tokens") or params.max_tokens
    seed = record.get("seed")
    if seed is None and params.seed is not None:
        seed = params.seed + row_index  # reproducible, yet each row draws its own numbers
    if seed is not None:
        seed += seed_offset
    temperature = record.get("temperature")
    top_p = record.get("top_p")
    return SamplingParams(
        max_tokens=max(1, min(int(max_tokens), max_model_len - prompt_len)),
        temperature=params.temperature if temperature is None else float(temperature),
        top_p=params.top_p if top_p is None else float(top_p),
        top_k=params.top_k,
        seed=seed,
        stop=list(params.stop),
        structured=engine_structured(for_row(params.structured, record)),
    )


def engine_structured(spec: StructuredSpec | None) -> StructuredOutput | None:
    """The engine's form of a row's constraint (what the grammar engine refuses fails that row there)."""
    if spec is None:
        return None
    return StructuredOutput(spec.kind, spec.value)  # StructuredOutput normalizes (a choice list to a tuple)


def stream_requests(
    llm: LLM,
    requests: Sequence[EngineRequest[Tag]],
    on_output: Callable[[EngineRequest[Tag], RequestOutput], None],
    should_stop: Callable[[], bool],
    poll_seconds: float,
) -> None:
    """Run `requests` in one engine stream, shortest prompts first (similar lengths run together),
    calling `on_output` as each finishes. Stops early when `should_stop` says so."""
    ordered = sorted(requests, key=lambda request: len(request.prompt_ids))
    stream = llm.stream(
        [request.prompt_ids for request in ordered],
        [request.sampling for request in ordered],
        should_cancel=should_stop,
        cancel_poll_seconds=poll_seconds,
    )
    # Closed here when on_output raises (a row's insert), while this shard still holds the engine:
    # left to the garbage collector, the suspended stream would abort its requests whenever it is
    # collected, in the middle of the next shard's stream, which would end with its rows unwritten.
    with closing(stream):
        for out in stream:
            on_output(ordered[out.index], out)
