"""The job report's quote section (jobs/domain/report.py): the quote the job got at submission beside
what it took, and the result cache's savings in the cost table."""

from __future__ import annotations

import numpy as np
import pytest

from jobs.domain.report import ReportData, quote_section, render

pytestmark = pytest.mark.unit

JOB = {
    "id": "job_1",
    "status": "completed",
    "model": "m",
    "request_counts": {"total": 4, "completed": 4, "failed": 0},
    "created_at": "2026-12-07T10:00:00Z",
    "finished_at": "2026-12-07T10:02:30Z",
    "params": {},
    "metadata": {},
    "priority": "high",
    "deadline": "2026-12-07T11:00:00Z",
}
METRICS = {
    "prompt_tokens": 1234,
    "output_tokens": 56,
    "device_seconds": 12.5,
    "cost_usd": 0.0042,
    "cached_rows": 2,
    "saved_prompt_tokens": 600,
    "saved_output_tokens": 30,
    "saved_device_seconds": 6.25,
}
QUOTE = {
    "prompt_tokens": 1200,
    "prompt_tokens_exact": False,
    "output_tokens_expected": 64,
    "device_seconds": 10.0,
    "cost_usd": 0.0035,
    "eta_seconds": 140.0,
}


def data(quote: dict | None) -> ReportData:
    empty = np.zeros(0, dtype=np.int32)
    return ReportData(job=JOB, metrics=METRICS, events=[], prompt_tokens=empty, output_tokens=empty, quote=quote)


def test_the_quote_at_submission_is_beside_what_the_job_took() -> None:
    html = render(data(QUOTE))
    assert 'data-key="quoted_prompt_tokens">1,200<' in html and 'data-key="actual_prompt_tokens">1,234<' in html
    assert "prompt tokens (from characters)" in html  # an estimate says so
    assert 'data-key="quoted_device_seconds">10<' in html and 'data-key="actual_device_seconds">12.5<' in html
    assert 'data-key="quoted_eta_seconds">140.0<' in html and 'data-key="actual_eta_seconds">150.0<' in html
    assert "priority high" in html and "due 2026-12-07T11:00:00Z" in html
    # The result cache's savings.
    assert 'data-key="saved_prompt_tokens">600<' in html and 'data-key="saved_output_tokens">30<' in html
    assert 'data-key="saved_device_seconds">6.25 s<' in html


def test_an_exact_quote_and_a_job_without_one() -> None:
    exact = quote_section(data({**QUOTE, "prompt_tokens_exact": True, "device_seconds": None,
                                "device_seconds_unknown_reason": "no shard of model 'm' has finished yet"}))  # fmt: skip
    assert ">prompt tokens<" in exact and 'data-key="quoted_device_seconds">—<' in exact
    assert "Not priced at submission: no shard of model &#x27;m&#x27; has finished yet" in exact
    assert quote_section(data(None)) == "" and 'id="quote"' not in render(data(None))
