"""The model registry: a worker records what it made of a model when it loads it; the API reads it at
submission (refusing a model the engine cannot load, checking max_tokens against the model's context)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from storage.models import RegisteredModel, utcnow


def record_model(
    session: Session,
    *,
    name: str,
    model_type: str | None,
    context_len: int | None,
    loadable: bool,
    error: str | None,
    recorded_by: str,
) -> None:
    """Insert or replace the model's row (the latest worker to load it has the last word); commits.
    One statement, so two workers starting together cannot both insert."""
    values = {
        "model_type": model_type,
        "context_len": context_len,
        "loadable": loadable,
        "error": error,
        "recorded_by": recorded_by,
        "recorded_at": utcnow(),
    }
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    statement = insert(RegisteredModel).values(name=name, **values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_=values))
    session.commit()


def get_model(session: Session, *, name: str) -> RegisteredModel | None:
    return session.scalars(select(RegisteredModel).where(RegisteredModel.name == name)).one_or_none()


def list_models(session: Session) -> list[RegisteredModel]:
    return list(session.scalars(select(RegisteredModel).order_by(RegisteredModel.name)))
