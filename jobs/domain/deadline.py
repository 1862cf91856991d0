"""A job's deadline: from its completion window (`30m`, `1h`, `24h`, `7d`) or an absolute ISO 8601
time, and whether the quote's ETA meets it (docs/scheduling.md)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from jobs.domain.errors import InputError

WINDOW = re.compile(r"^([1-9][0-9]{0,5})([mhd])$")
UNIT = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1)}
MAX_WINDOW = timedelta(days=365)
WINDOW_FORMS = 'a number and a unit, m, h or d: "30m", "1h", "24h", "7d"'


def window_length(window: str) -> timedelta:
    """`1h` as one hour; a ValueError that says the accepted forms otherwise."""
    match = WINDOW.match(window)
    if match is None:
        raise ValueError(f"completion_window {window[:32]!r} is not {WINDOW_FORMS}")
    length = int(match.group(1)) * UNIT[match.group(2)]
    if length > MAX_WINDOW:
        raise ValueError(f"completion_window {window!r} is longer than {MAX_WINDOW.days}d")
    return length


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 time with its UTC offset (`Z` or `+01:00`); a ValueError otherwise."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"deadline {text[:40]!r} is not an ISO 8601 time such as 2026-12-08T09:00:00Z"
        ) from None
    if moment.tzinfo is None:
        raise ValueError(f"deadline {text[:40]!r} has no UTC offset: add Z or +HH:MM")
    return moment


def job_deadline(*, completion_window: str | None, deadline: str | None, now: datetime) -> datetime | None:
    """When the job is due, or None without a window or deadline; a deadline already past is a 4xx."""
    if completion_window is not None:
        return now + window_length(completion_window)
    if deadline is None:
        return None
    due = parse_deadline(deadline)
    if due <= now:
        raise InputError(f"deadline {deadline!r} has already passed (now is {now.isoformat()})", field="deadline")
    return due


def missed_by(*, deadline: datetime | None, eta_seconds: float | None, now: datetime) -> str | None:
    """Why the quote's ETA misses the deadline, or None when it meets it (or either is unknown: a model
    with no measured throughput has no ETA, and the job is not told it is late)."""
    if deadline is None or eta_seconds is None:
        return None
    eta = now + timedelta(seconds=eta_seconds)
    if eta <= deadline:
        return None
    late = (eta - deadline).total_seconds()
    return (
        f"the quote expects the job done in {eta_seconds:.0f} s, {late:.0f} s after its deadline "
        f"{deadline.isoformat(timespec='seconds')}"
    )
