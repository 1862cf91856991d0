"""What a shard run works in (WorkerContext) and what it reports back (ShardOutcome)."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.settings import Settings
from storage.blobs import BlobStore


@dataclass
class WorkerContext:
    settings: Settings
    sessions: sessionmaker[Session]
    blobs: BlobStore
    # Set when the worker is shutting down (SIGTERM): running shards stop between engine steps,
    # keep the rows they finished and hand the rest back.
    stopping: threading.Event = field(default_factory=threading.Event)

    def owner(self) -> str:
        """Who holds a lease: host, process and thread (a threads pool runs shards side by side)."""
        return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


@dataclass
class ShardOutcome:
    job_id: str
    shard_index: int
    claim: str
    status: str | None = None  # the shard's status after this run, when this run finished it
    rows_written: int = 0
    ready_to_finalize: bool = False
    handed_back: bool = False  # the worker is shutting down; the shard's unfinished rows run elsewhere

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ShardHandedBack(Exception):
    """The worker is shutting down: the shard was released with its finished rows kept."""

    def __init__(self, rows_written: int) -> None:
        super().__init__(f"handed back after {rows_written} rows")
        self.rows_written = rows_written
