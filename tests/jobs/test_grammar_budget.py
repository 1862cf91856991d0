"""The grammar budget counts the engine's time only (jobs/domain/grammar_check.py, issue 28): a submission
that waits for the checker's process to (re)start, or for another submission's check to finish, is not
refused for that wait. A fake child stands in for the grammar engine (`slow` in a constraint never answers)."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

from jobs.domain.grammar_check import GrammarChecker, SubmissionGrammar
from jobs.domain.structured_spec import StructuredSpec

FAKE_CHILD = textwrap.dedent(
    """
    import json, sys, time
    time.sleep(float(sys.argv[1]))  # a slow start, as importing torch and xgrammar is on a busy runner
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if "slow" in json.dumps(json.loads(line).get("value")):
            time.sleep(30)
        print(json.dumps({"refusal": None}), flush=True)
    """
)
WITH_PATTERN = StructuredSpec(kind="json_schema", value='{"type":"string","pattern":"p+"}')  # two questions


def checker(start_s: float) -> GrammarChecker:
    return GrammarChecker(command=[sys.executable, "-c", FAKE_CHILD, str(start_s)])


def test_waiting_for_the_checker_to_start_is_not_counted() -> None:
    slow_start = checker(1.5)
    try:
        grammar = SubmissionGrammar(slow_start, budget_s=0.5)
        started = time.monotonic()
        assert grammar(WITH_PATTERN) is None  # the pattern and the schema both asked and answered
        assert time.monotonic() - started >= 1.5
        assert grammar.compiled == 2 and grammar.spent < 0.5
    finally:
        slow_start.close()


def test_waiting_for_another_submissions_check_is_not_counted() -> None:
    shared = checker(0)
    try:
        assert SubmissionGrammar(shared, budget_s=1.0)(StructuredSpec(kind="regex", value="warm")) is None
        refusals: list[str | None] = []
        other = threading.Thread(
            target=lambda: refusals.append(SubmissionGrammar(shared, budget_s=1.0)(StructuredSpec(kind="regex", value="slow")))
        )
        other.start()
        time.sleep(0.2)  # the other submission holds the checker for its whole budget
        grammar = SubmissionGrammar(shared, budget_s=0.5)
        assert grammar(WITH_PATTERN) is None
        other.join()
        assert refusals and "time budget" in (refusals[0] or ""), refusals
        assert grammar.compiled == 2
    finally:
        shared.close()
