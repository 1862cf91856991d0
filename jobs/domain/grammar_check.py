"""Whether the grammar engine accepts a structured-output constraint, asked at submission.

The domain and the API never import torch, and xgrammar imports it; so one long-lived child process per
checker runs `python -m worker.engine.grammar_check` (the engine's own grammar construction) and answers
over pipes. Started on the first constrained submission; answers are cached by constraint. Where the child
cannot start (xgrammar missing) or does not answer in time, the check says nothing (`None`) and the worker
still fails such a row alone, with the same reason.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

from jobs.domain.structured_spec import StructuredSpec

log = logging.getLogger(__name__)

CHECK_MODULE = "worker.engine.grammar_check"
START_TIMEOUT_S = 60.0  # the child imports torch and xgrammar
ANSWER_TIMEOUT_S = 10.0
CACHE_ENTRIES = 1024

GrammarRefusal = Callable[[StructuredSpec], str | None]  # the grammar engine's refusal, or None


class _NoAnswer(Exception):
    """The child could not be asked (not started, died, too slow): the check says nothing."""


class GrammarChecker:
    """`refusal(spec)`: the grammar engine's reason for refusing `spec`, or None (accepted, or unknown)."""

    def __init__(self, command: list[str] | None = None) -> None:
        self._command = command or [sys.executable, "-m", CHECK_MODULE]
        self._process: subprocess.Popen[str] | None = None
        self._unavailable = False  # the child could not start: stop trying
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    def refusal(self, spec: StructuredSpec) -> str | None:
        key = (spec.kind, json.dumps(spec.value))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                answer = self._ask({"kind": spec.kind, "value": spec.value})
            except _NoAnswer:
                return None
            self._cache[key] = answer
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return answer

    def close(self) -> None:
        with self._lock:
            self._stop()

    # -- the child process (called under the lock) ------------------------------------------------------

    def _ask(self, request: dict) -> str | None:
        process = self._started()
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            line = _read_line(process, ANSWER_TIMEOUT_S)
            return json.loads(line)["refusal"]
        except (OSError, ValueError, KeyError, TimeoutError) as exc:
            log.warning("grammar check failed (%s); restarting its process on the next check", exc)
            self._stop()
            raise _NoAnswer from exc

    def _started(self) -> subprocess.Popen[str]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._unavailable:
            raise _NoAnswer
        try:
            self._process = subprocess.Popen(
                self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1,
            )  # fmt: skip
            ready = json.loads(_read_line(self._process, START_TIMEOUT_S))
            if not ready.get("ready"):
                raise ValueError(f"unexpected first line {ready!r}")
        except (OSError, ValueError, TimeoutError) as exc:
            log.warning("the grammar check cannot run (%s): constraints are checked by the workers only", exc)
            self._stop()
            self._unavailable = True
            raise _NoAnswer from exc
        return self._process

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """One line of the child's stdout within `timeout` seconds (a reader thread: pipes have no timeout)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive() or not lines:
        raise TimeoutError(f"no answer from the grammar check within {timeout:.0f} s")
    if not lines[0]:
        raise OSError(f"the grammar check process exited (code {process.poll()})")
    return lines[0]
