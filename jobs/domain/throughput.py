"""A model's measured throughput, fitted from its profile rows (storage/profile_store.py): seconds per
prompt token and per output token, seconds per row, and how much of max_tokens rows really use. Pure
arithmetic over the stored sums, so a quote costs no more than reading a few rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

# How the two rates came out of the sums: both fitted (least_squares); one of them fitted alone because
# the joint fit made the other negative; or one rate for every token, when the shards' prompt and
# output tokens rose together (one shard, or shards of one shape) and cannot be told apart.
Fit = Literal["least_squares", "output_only", "prompt_only", "tokens_combined"]
# Below this, the normal equations' determinant is treated as zero (relative to its scale).
COLLINEAR = 1e-6


class ProfileSums(Protocol):
    """A throughput_profiles row (storage.models.ThroughputProfile), as far as the fit reads it."""

    worker_class: str
    shards: int
    rows: int
    prompt_tokens: int
    output_tokens: int
    busy_seconds: float
    sum_pp: float
    sum_po: float
    sum_oo: float
    sum_ps: float
    sum_os: float
    capped_output_tokens: int
    capped_max_tokens: int


@dataclass(frozen=True)
class Rates:
    prompt_seconds_per_token: float
    output_seconds_per_token: float
    seconds_per_row: float
    output_fraction: float | None  # output tokens / max_tokens of past generate rows; None: none yet
    shards: int  # shards measured
    worker_classes: tuple[str, ...]
    fit: Fit

    def device_seconds(self, prompt_tokens: float, output_tokens: float) -> float:
        return prompt_tokens * self.prompt_seconds_per_token + output_tokens * self.output_seconds_per_token


def fit_rates(profiles: Sequence[ProfileSums]) -> Rates | None:
    """The model's rates over every worker class that ran it (the fleet serving its queue), or None
    when no shard with measured work finished yet."""
    total = _Totals()
    for row in profiles:
        total.add(row)
    if total.shards == 0 or total.busy_seconds <= 0 or total.prompt_tokens + total.output_tokens <= 0:
        return None
    prompt_rate, output_rate, fit = _fit(total)
    return Rates(
        prompt_seconds_per_token=prompt_rate,
        output_seconds_per_token=output_rate,
        seconds_per_row=total.busy_seconds / total.rows if total.rows else 0.0,
        output_fraction=(
            min(1.0, total.capped_output_tokens / total.capped_max_tokens)
            if total.capped_max_tokens
            else None
        ),
        shards=total.shards,
        worker_classes=tuple(row.worker_class for row in profiles if row.shards),
        fit=fit,
    )


@dataclass
class _Totals:
    shards: int = 0
    rows: int = 0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    busy_seconds: float = 0.0
    sum_pp: float = 0.0
    sum_po: float = 0.0
    sum_oo: float = 0.0
    sum_ps: float = 0.0
    sum_os: float = 0.0
    capped_output_tokens: int = 0
    capped_max_tokens: int = 0

    def add(self, row: ProfileSums) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(row, name))


def _fit(t: _Totals) -> tuple[float, float, Fit]:
    """Least squares through the origin for seconds = a * prompt + b * output over the shards, from
    the sums alone; a and b stay non-negative (a negative rate would quote work as free)."""
    det = t.sum_pp * t.sum_oo - t.sum_po * t.sum_po
    if det > COLLINEAR * t.sum_pp * t.sum_oo:
        a = (t.sum_ps * t.sum_oo - t.sum_os * t.sum_po) / det
        b = (t.sum_os * t.sum_pp - t.sum_ps * t.sum_po) / det
        if a >= 0 and b >= 0:
            return a, b, "least_squares"
        if a < 0 and t.sum_oo > 0:
            return 0.0, t.sum_os / t.sum_oo, "output_only"
        if b < 0 and t.sum_pp > 0:
            return t.sum_ps / t.sum_pp, 0.0, "prompt_only"
    combined = t.busy_seconds / (t.prompt_tokens + t.output_tokens)
    return combined, combined, "tokens_combined"
