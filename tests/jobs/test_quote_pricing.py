"""The quote's arithmetic (jobs/domain/throughput.py, jobs/domain/quote.py), without a service: rates
fitted from profile sums, and the quote priced from a job's counts and those rates."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jobs.domain.quote import CHARS_PER_TOKEN, price
from jobs.domain.throughput import fit_rates

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)


@dataclass
class Row:
    """A throughput_profiles row made of shards (prompt tokens, output tokens, seconds, rows, cap)."""

    worker_class: str = "avx512"
    shards: int = 0
    rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    busy_seconds: float = 0.0
    sum_pp: float = 0.0
    sum_po: float = 0.0
    sum_oo: float = 0.0
    sum_ps: float = 0.0
    sum_os: float = 0.0
    capped_output_tokens: int = 0
    capped_max_tokens: int = 0

    def add(self, p: int, o: int, s: float, rows: int = 1, cap: int = 0) -> Row:
        self.shards += 1
        self.rows += rows
        self.prompt_tokens += p
        self.output_tokens += o
        self.busy_seconds += s
        self.sum_pp += p * p
        self.sum_po += p * o
        self.sum_oo += o * o
        self.sum_ps += p * s
        self.sum_os += o * s
        self.capped_output_tokens += o if cap else 0
        self.capped_max_tokens += cap
        return self


def test_no_finished_shard_means_no_rates() -> None:
    assert fit_rates([]) is None
    assert fit_rates([Row()]) is None


def test_shards_of_different_shapes_give_both_rates() -> None:
    # seconds = 0.001 per prompt token + 0.02 per output token, exactly
    row = Row().add(1000, 100, 3.0, rows=10, cap=10 * 200).add(200, 300, 6.2, rows=10, cap=10 * 200)
    rates = fit_rates([row])
    assert rates.fit == "least_squares"
    assert rates.prompt_seconds_per_token == pytest.approx(0.001)
    assert rates.output_seconds_per_token == pytest.approx(0.02)
    assert rates.seconds_per_row == pytest.approx(9.2 / 20)
    assert rates.output_fraction == pytest.approx(400 / 4000)
    assert rates.device_seconds(500, 50) == pytest.approx(0.5 + 1.0)


def test_one_shard_shape_gives_one_rate_per_token() -> None:
    rates = fit_rates([Row().add(300, 100, 4.0)])
    assert rates.fit == "tokens_combined"
    assert rates.prompt_seconds_per_token == rates.output_seconds_per_token == pytest.approx(4.0 / 400)
    assert rates.output_fraction is None  # no shard with a max_tokens cap


def test_rates_never_go_negative() -> None:
    # Prompt-heavy shards that took less time: the joint fit's prompt rate would be negative.
    rates = fit_rates([Row().add(1000, 10, 1.0).add(10, 100, 2.0).add(2000, 100, 1.5)])
    assert rates.prompt_seconds_per_token >= 0 and rates.output_seconds_per_token >= 0


def test_worker_classes_pool_into_the_models_rates() -> None:
    cpu, gpu = Row("avx512").add(100, 100, 2.0), Row("cuda").add(100, 100, 0.2)
    rates = fit_rates([cpu, gpu])
    assert rates.worker_classes == ("avx512", "cuda") and rates.shards == 2
    assert rates.device_seconds(100, 100) == pytest.approx(1.1)  # the fleet's mean


def test_a_quote_without_rates_says_why_and_prices_nothing() -> None:
    quote = price(
        model="m", rows=5, rows_to_run=4, shards=2, prompt_chars=400, max_tokens=10, output_tokens_max=40, rates=None,
        backlog=7, seen_workers=0, assumed_workers=3, device_hour_usd=1.0,
    )  # fmt: skip
    assert quote.prompt_tokens == 400 / CHARS_PER_TOKEN and not quote.prompt_tokens_exact
    assert (quote.output_tokens_max, quote.output_tokens_expected, quote.output_tokens_basis) == (
        40,
        40,
        "max_tokens",
    )
    assert quote.device_seconds is None and quote.cost_usd is None and quote.eta_seconds is None
    assert "no shard of model 'm'" in quote.device_seconds_unknown_reason
    assert (quote.queue.workers, quote.queue.workers_source, quote.queue.backlog_rows) == (3, "setting", 7)


def test_a_quote_prices_the_job_and_waits_for_the_backlog() -> None:
    row = Row().add(1000, 100, 3.0, rows=10, cap=10 * 200).add(200, 300, 6.2, rows=10, cap=10 * 200)
    rates = fit_rates([row])
    quote = price(
        model="m", rows=20, rows_to_run=20, shards=4, prompt_chars=4000, max_tokens=50, output_tokens_max=1000,
        rates=rates,
        backlog=100, seen_workers=2, assumed_workers=1, device_hour_usd=3.6,
    )  # fmt: skip
    assert quote.output_tokens_expected == round(20 * 50 * 0.1) and quote.output_tokens_basis == "history"
    expected = 1000 * 0.001 + 100 * 0.02
    assert quote.device_seconds == pytest.approx(expected)
    assert quote.cost_usd == pytest.approx(expected / 1000)
    backlog_seconds = 100 * 9.2 / 20
    assert quote.queue.backlog_device_seconds == pytest.approx(backlog_seconds)
    assert (quote.queue.workers, quote.queue.workers_source) == (2, "observed")
    assert quote.eta_seconds == pytest.approx(backlog_seconds / 2 + expected / 2)
    assert quote.throughput.prompt_tokens_per_second == pytest.approx(1000)
    assert quote.throughput.output_tokens_per_second == pytest.approx(50)
