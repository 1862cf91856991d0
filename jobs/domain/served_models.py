"""What the service knows of a model at submission: the context its jobs are checked against, and, when
a worker found that the engine cannot load it, why. Workers record each model they load in the model
registry (storage.model_store); a model no worker has recorded yet is accepted as before, with the
operator's cap or UNRECORDED_CONTEXT as its context."""

from __future__ import annotations

from dataclasses import dataclass

from storage.models import RegisteredModel

# The context assumed for a model no worker has recorded yet (and no cap set): the old default for every
# model. Should the model's own be shorter, the worker still cuts each row's max_tokens to fit it.
UNRECORDED_CONTEXT = 2048


@dataclass(frozen=True)
class ServedModel:
    name: str
    context_len: int  # tokens: what max_tokens and prompts must fit in
    refusal: str | None = None  # why the engine cannot load it ("model ... cannot be served: ...")


def model_context(own: int | None, cap: int | None) -> int:
    """The context a model is served with: its own (max_position_embeddings) capped by
    FREIGHT_MAX_MODEL_LEN when set; unknown, the cap or UNRECORDED_CONTEXT. The one rule for the API's
    checks and the worker's engine (worker/llm_pool.py), so they agree."""
    if own is None:
        return cap if cap is not None else UNRECORDED_CONTEXT
    return own if cap is None else min(own, cap)


def unservable(name: str, loader_error: str) -> str:
    """The one wording of a refused model, at submission (4xx) and on a job whose shards fail on it."""
    return f"model {name!r} cannot be served: {loader_error}"


def served_model(name: str, record: RegisteredModel | None, cap: int | None) -> ServedModel:
    if record is None:
        return ServedModel(name, model_context(None, cap))
    refusal = None if record.loadable else unservable(name, record.error or "the engine cannot load it")
    return ServedModel(name, model_context(record.context_len, cap), refusal)
