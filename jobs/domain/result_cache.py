"""Which rows may reuse a cached result (docs/result-cache.md): what a job asked for, else the default
rule: greedy and seeded rows (the same request gives the same output), not unseeded sampling (a client
that samples without a seed wants a fresh draw)."""

from __future__ import annotations


def reuses_result(requested: bool | None, *, temperature: float, seed: int | None) -> bool:
    """Whether a row with this sampling reads and feeds the result cache; `requested` is the job's
    `reuse_results` (None: the default rule)."""
    if requested is not None:
        return requested
    return temperature == 0 or seed is not None
