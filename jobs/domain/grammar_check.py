"""Whether the grammar engine accepts a structured-output constraint, asked at submission, within a budget.

The domain and the API never import torch, and xgrammar imports it; so one long-lived child process per
checker runs the `freight-grammar-check` command (an entry point declared in pyproject.toml: the engine's
own grammar construction) and answers over pipes. Started on the first constrained submission; answers are
cached by constraint. Where the child cannot start (xgrammar missing, the package not installed), the
check says nothing (`None`) and the worker still fails such a row alone, with the same reason.

Budget (docs/input-rules.md): one submission may spend `FREIGHT_GRAMMAR_BUDGET_SECONDS` on its checks, all
of them together (`SubmissionGrammar`): the engine's time, so waiting for the child to (re)start or for
another submission's check is not counted. A constraint whose compilation does not finish in what is left is
refused (422, "over the time budget"), never waved through; the stuck child is killed and a warm standby
child takes its place at once (`GrammarChecker`), so the next submission does not wait for a start. Each
distinct constraint (by its canonical form: `canonical_key`) is asked at most once per submission and once
per process, and a schema's patterns are asked as the regexes they are, so a pattern is refused exactly
when the same bare `regex` would be.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from jobs.domain.constraint_limits import schema_patterns
from jobs.domain.structured_spec import StructuredSpec

log = logging.getLogger(__name__)

CHECK_COMMAND = "freight-grammar-check"  # [project.scripts] in pyproject.toml
START_TIMEOUT_S = 60.0  # the child imports torch and xgrammar
ANSWER_TIMEOUT_S = 10.0
CACHE_ENTRIES = 1024

GrammarRefusal = Callable[[StructuredSpec], str | None]  # the grammar engine's refusal, or None


class _NoAnswer(Exception):
    """The child could not be asked (not started, died): the check says nothing."""


class OverBudget(Exception):
    """The child did not answer within the time it was given."""


@dataclass(frozen=True)
class Checked:
    """An answer of the checker: the engine's refusal or None, and the seconds the engine worked on it
    (0 for a cached answer). Waiting for the child to start, or for another submission's check to end,
    is not the constraint's work and is not counted."""

    refusal: str | None
    engine_s: float


def check_command() -> list[str]:
    """The grammar check's command: the entry point installed with this Python (its scripts folder, so a
    virtual environment need not be activated), else the one on PATH. Not installed (a checkout that was
    never `pip install`ed): a name that fails to start, so the check says nothing, with a warning."""
    beside = Path(sys.executable).with_name(CHECK_COMMAND)
    return [str(beside) if beside.is_file() else shutil.which(CHECK_COMMAND) or CHECK_COMMAND]


def over_budget_message(spec: StructuredSpec, seconds: float) -> str:
    return (
        f"{spec.kind} could not be checked within the time budget ({seconds:g} s, "
        "FREIGHT_GRAMMAR_BUDGET_SECONDS): the grammar engine takes too long to compile it; simplify it"
    )


@dataclass
class _Child:
    """One `freight-grammar-check` process, started in the background: `ready` is set once its ready line
    came (`ok`) or it failed to start."""

    process: subprocess.Popen[str] | None
    ready: threading.Event = field(default_factory=threading.Event)
    ok: bool = False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def canonical_key(spec: StructuredSpec) -> tuple[str, str]:
    """The cache key of a constraint: a json_schema is parsed and written with sorted keys and compact
    separators, so the same schema sent with another key order or other whitespace is one entry (whether
    the grammar engine accepts a schema does not depend on either)."""
    value = spec.value
    if spec.kind == "json_schema" and isinstance(value, str):
        try:
            # the text was parsed within the schema limits already (structured_spec.schema_text)
            return spec.kind, json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        except ValueError:
            pass
    return spec.kind, json.dumps(value)


class GrammarChecker:
    """`refusal(spec)`: the grammar engine's reason for refusing `spec`, or None (accepted, or unknown).
    `ask(spec, timeout)` is the same with a deadline: OverBudget when the engine takes longer.

    Starting a child costs seconds (it imports torch and xgrammar). So once the first child is ready a
    second one is started in the background and kept warm (`standby`); when the active child is killed
    (over its budget) or dies, the standby takes its place at once and another standby is started, so
    the next submission does not wait for a start. The price is a second idle process."""

    def __init__(self, command: list[str] | None = None, *, standby: bool = True) -> None:
        self._command = command or check_command()
        self._keep_standby = standby
        self._active: _Child | None = None
        self._standby: _Child | None = None
        self._unavailable = False  # the child could not start: stop trying
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self.spawned = 0  # children started (tests count them)

    def refusal(self, spec: StructuredSpec) -> str | None:
        try:
            return self.ask(spec, ANSWER_TIMEOUT_S)
        except OverBudget:
            return over_budget_message(spec, ANSWER_TIMEOUT_S)

    def ask(self, spec: StructuredSpec, timeout: float, *, cache_timeout: bool = True) -> str | None:
        """The engine's refusal, None (accepted, or no child to ask), or OverBudget. An over-budget answer
        given the full `timeout` is cached as a refusal (`cache_timeout`): the next ask is instant."""
        return self.check(spec, timeout, cache_timeout=cache_timeout).refusal

    def check(
        self, spec: StructuredSpec, timeout: float, *, cache_timeout: bool = True, budget_s: float | None = None
    ) -> Checked:
        """`ask`, with the engine's time: `timeout` bounds the engine's work only. `budget_s`: the budget a
        cached over-budget refusal names (else `timeout`)."""
        key = canonical_key(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return Checked(self._cache[key], 0.0)
            try:
                answer = self._ask({"kind": spec.kind, "value": spec.value}, timeout)
            except _NoAnswer:
                return Checked(None, 0.0)
            except OverBudget:
                if cache_timeout:
                    self._remember(key, over_budget_message(spec, budget_s or timeout))
                raise
            self._remember(key, answer.refusal)
            return answer

    def count_tokens(self, request: dict, timeout: float) -> list[int | None] | None:
        """A quote's exact prompt tokens, counted by the same child with the model's tokenizer
        (worker/engine/token_count.py says the request and the answer; jobs/domain/prompt_tokens.py asks);
        None when it cannot answer within `timeout` (no child, the model not on this host)."""
        with self._lock:
            try:
                process = self._started()
            except _NoAnswer:
                return None
            try:
                process.stdin.write(json.dumps({"count_tokens": request}) + "\n")
                process.stdin.flush()
                answer = json.loads(_read_line(process, timeout))
            except (TimeoutError, OSError, ValueError) as exc:
                log.warning("token count failed (%s); the grammar check's process is replaced", exc)
                self._replace_active()
                return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            log.info("no exact prompt tokens: %s", str(answer)[:200])
            return None
        return tokens

    def standby_ready(self, timeout: float) -> bool:
        """Whether a warm standby child is ready within `timeout` seconds (it is started after the first
        check; tests and operators wait on it)."""
        standby = self._standby
        return standby is not None and standby.ready.wait(timeout) and standby.ok and standby.alive()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _remember(self, key: tuple[str, str], answer: str | None) -> None:
        self._cache[key] = answer
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    # -- the child processes (called under the lock) ----------------------------------------------------

    def _ask(self, request: dict, timeout: float) -> Checked:
        process = self._started()
        started = time.monotonic()  # after the start: only the engine's work is timed
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            line = _read_line(process, timeout)
            return Checked(json.loads(line)["refusal"], time.monotonic() - started)
        except TimeoutError as exc:
            log.warning("grammar check over its budget of %.1f s; its process is replaced", timeout)
            self._replace_active()  # by the warm standby: the next check does not wait for a start
            raise OverBudget from exc
        except (OSError, ValueError, KeyError) as exc:
            log.warning("grammar check failed (%s); its process is replaced", exc)
            self._replace_active()
            raise _NoAnswer from exc

    def _started(self) -> subprocess.Popen[str]:
        if self._active is None or not self._active.alive():
            if self._unavailable:
                raise _NoAnswer
            self._replace_active()
        active = self._active
        assert active is not None
        # Waiting for a start is not counted in a submission's budget: it is the same for every constraint.
        if not active.ready.wait(START_TIMEOUT_S) or not active.ok or active.process is None:
            log.warning("the grammar check cannot run: constraints are checked by the workers only")
            self._stop()
            self._unavailable = True
            raise _NoAnswer
        if self._keep_standby and (self._standby is None or not self._standby.alive()):
            self._standby = self._spawn()  # after the active one is ready: the two starts do not compete
        return active.process

    def _replace_active(self) -> None:
        """Kill the active child; the standby (if it is alive: it may still be starting) takes its place,
        else a new child is started. Returns at once."""
        if self._active is not None:
            self._active.stop()
        standby, self._standby = self._standby, None
        if standby is not None and not standby.alive():
            standby.stop()
            standby = None
        self._active = standby or self._spawn()

    def _spawn(self) -> _Child:
        """Start a child and, on a thread, wait for its ready line; returns at once."""
        self.spawned += 1
        try:
            process = subprocess.Popen(
                self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1,
            )  # fmt: skip
        except OSError as exc:
            log.warning("the grammar check cannot start (%s)", exc)
            child = _Child(None)
            child.ready.set()
            return child
        child = _Child(process)

        def wait_ready() -> None:
            try:
                line = process.stdout.readline()
                child.ok = bool(line) and bool(json.loads(line).get("ready"))
            except (OSError, ValueError, AttributeError):
                child.ok = False
            child.ready.set()

        threading.Thread(target=wait_ready, daemon=True, name="grammar-check-start").start()
        return child

    def _stop(self) -> None:
        for child in (self._active, self._standby):
            if child is not None:
                child.stop()
        self._active = self._standby = None


class SubmissionGrammar:
    """The grammar check of one submission: a `GrammarRefusal` that spends at most `budget_s` seconds of
    the engine's time in all, asks each distinct constraint once, and asks a schema's patterns as regexes. Without a checker
    (FREIGHT_GRAMMAR_CHECK=0) it says nothing, as the checker does when its child cannot run."""

    def __init__(self, checker: GrammarChecker | None, budget_s: float) -> None:
        self.checker = checker
        self.budget_s = budget_s
        self.spent = 0.0  # the engine's seconds on this submission's constraints (Checked.engine_s)
        self.asked: dict[tuple[str, str], str | None] = {}
        self.compiled = 0  # constraints sent to the checker (tests count them)

    def __call__(self, spec: StructuredSpec) -> str | None:
        if self.checker is None:
            return None
        if spec.kind == "json_schema" and isinstance(spec.value, str):
            try:
                schema = json.loads(spec.value)  # checked and bounded already (structured_spec.schema_text)
            except ValueError:
                schema = None
            for pattern in schema_patterns(schema):
                refused = self._once(StructuredSpec(kind="regex", value=pattern))
                if refused is not None:
                    return f"json_schema pattern {pattern[:60]!r}: {refused}"
        return self._once(spec)

    def _once(self, spec: StructuredSpec) -> str | None:
        key = canonical_key(spec)
        if key not in self.asked:
            self.asked[key] = self._ask(spec)
        return self.asked[key]

    def _ask(self, spec: StructuredSpec) -> str | None:
        # The engine's time, not the wall clock: a submission that waits for the checker's (re)start, or
        # for another tenant's check holding it, is not refused for that wait.
        left = self.budget_s - self.spent
        if left <= 0:
            return over_budget_message(spec, self.budget_s)
        self.compiled += 1
        try:
            # Only an over-budget answer given (nearly) the whole budget is remembered beyond this
            # submission; a schema's patterns, asked first, take a little of it.
            checked = self.checker.check(
                spec, left, cache_timeout=left >= self.budget_s * 0.9, budget_s=self.budget_s
            )
        except OverBudget:
            self.spent = self.budget_s
            return over_budget_message(spec, self.budget_s)
        self.spent += checked.engine_s
        return checked.refusal


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """One line of the child's stdout within `timeout` seconds (a reader thread: pipes have no timeout)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive() or not lines:
        raise TimeoutError(f"no answer from the grammar check within {timeout:.1f} s")
    if not lines[0]:
        raise OSError(f"the grammar check process exited (code {process.poll()})")
    return lines[0]
