"""What this worker makes of a model before loading it, from its config alone (the loader's checks: its
family and own context, or the loader's refusal), and the model registry row it records for the API
(storage.model_store): a model the engine cannot load is then refused at submission."""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from storage import model_store
from worker.engine.loader import load_config

log = logging.getLogger(__name__)


class UnservableModel(ValueError):
    """The engine cannot load this model (the loader refused it): running its shards again cannot help."""


@dataclass(frozen=True)
class ModelFacts:
    name: str  # as jobs and queues name it
    model_type: str | None
    # the model's own context (max_position_embeddings), or the shorter one a worker's KV pool cut it to
    # (llm_pool.py); None when refused
    context_len: int | None
    error: str | None = None  # the loader's refusal

    @property
    def loadable(self) -> bool:
        return self.error is None


def inspect_model(name: str, cache_dir: Path | str | None = None) -> ModelFacts:
    """The model's facts from its config (an alias is pulled first, as loading would). ValueError and
    FileNotFoundError are the loader's refusals of the model itself (unsupported architecture, not a
    model folder); anything else (a failed download) is raised as before."""
    try:
        config = load_config(name, cache_dir)
    except (ValueError, FileNotFoundError) as exc:
        return ModelFacts(name, _declared_model_type(name), None, str(exc))
    return ModelFacts(name, config.model_type, config.max_position_embeddings)


def _declared_model_type(name: str) -> str | None:
    """The model_type a refused folder's config.json names, if it has one."""
    try:
        value = json.loads((Path(name).expanduser() / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return str(value)[:200] if value is not None else None


class ModelRegistry:
    """Records ModelFacts in the database. Best effort: without the row the API treats the model as
    unrecorded (as before the registry), so a failed write must not stop the engine."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self.recorded_by = f"{socket.gethostname()}:{os.getpid()}"

    def record(self, facts: ModelFacts) -> None:
        try:
            with self.sessions() as session:
                model_store.record_model(
                    session,
                    name=facts.name,
                    model_type=facts.model_type,
                    context_len=facts.context_len,
                    loadable=facts.loadable,
                    error=facts.error,
                    recorded_by=self.recorded_by,
                )
        except SQLAlchemyError:
            log.exception("could not record %s in the model registry", facts.name)
