"""The kinds of shard the executor runs, chosen by the job's parameters. A kind turns the shard's input
rows into engine requests (worker.shard.requests: one sampling mapping, one stream loop) and the
outputs into result records; the executor does everything around it (claim, lease, attempt, finish).
A new kind (say OpenAI batch lines) is one more class with `run` and a line in `kind_for`."""

from __future__ import annotations

from jobs.domain.schemas import ResolvedParams
from worker.shard.plain import PlainKind
from worker.shard.run import ShardKind
from worker.shard.summarize import SummarizeKind


def kind_for(params: ResolvedParams) -> ShardKind:
    return SummarizeKind() if params.summarize is not None else PlainKind()
