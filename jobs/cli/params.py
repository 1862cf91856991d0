"""Job parameters from CLI flags (`--params` JSON first, then individual flags on top)."""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from jobs.domain.errors import InputError
from jobs.domain.schemas import JobParams

FLAG_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "template",
    "prompt_column",
    "chat",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "task",
    "column",
    "style",
    "long_documents",
    "id_column",
)


def params_dict_from_args(args: argparse.Namespace) -> dict:
    payload = json.loads(args.params) if args.params else {}
    if not isinstance(payload, dict):
        raise InputError("--params must be a JSON object")
    for name in FLAG_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            payload[name] = value
    if getattr(args, "template", None):
        # A shell argument cannot easily hold a newline: accept \n and \t escapes in --template.
        payload["template"] = args.template.replace("\\n", "\n").replace("\\t", "\t")
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InputError(f"--metadata takes KEY=VALUE, got {item!r}")
        payload.setdefault("metadata", {})[key] = value
    return payload


def params_from_args(args: argparse.Namespace) -> JobParams:
    try:
        return JobParams.model_validate(params_dict_from_args(args))
    except ValidationError as exc:
        raise InputError(f"invalid job parameters: {exc}") from exc
