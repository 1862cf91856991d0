"""Job-parameter flags generated from JobParams' fields (name, type, choices, help, default), and the
params they give (`--params` JSON first, then individual flags on top), checked by `job_params`."""

from __future__ import annotations

import argparse
import json
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from jobs.domain.errors import InputError
from jobs.domain.schemas import JobParams, job_params

# JobParams fields whose flag is written by hand (a generated one would not fit), and why.
HAND_WRITTEN_FLAGS = {
    "metadata": "a mapping: --metadata KEY=VALUE, repeatable",
}
# Shorter names a generated flag is also known by.
FLAG_ALIASES = {"completion_window": ("--window",)}
# Fields of the summarize task, under their own heading in `freight run` / `freight submit`.
SUMMARIZE_TASK_FIELDS = ("task", "column", "style", "long_documents", "id_column")


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def flag_fields() -> tuple[str, ...]:
    """JobParams fields with a generated flag, in the model's order."""
    return tuple(name for name in JobParams.model_fields if name not in HAND_WRITTEN_FLAGS)


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _help(info: FieldInfo, override: str | None) -> str | None:
    text = override if override is not None else info.description
    if info.default not in (None, PydanticUndefined) and info.default_factory is None:
        shown = f"(default: {info.default})"
        text = f"{text} {shown}" if text else shown
    return text.replace("%", "%%") if text else None


def add_field_flag(target: Any, name: str, help: str | None = None) -> None:
    """The flag of JobParams field `name` on a parser or argument group. Its default is None (unset:
    the model's default or `--params` applies), and its type is the field's own (strict JobParams
    refuses `"8"` for an int): int and float convert, bool is --x/--no-x, Literal gives choices, a
    list of strings repeats."""
    info = JobParams.model_fields[name]
    kind = _without_none(info.annotation)
    options: dict[str, Any] = {"dest": name, "default": None, "help": _help(info, help)}
    if get_origin(kind) is Literal:
        options["choices"] = list(get_args(kind))
    elif kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif kind in (int, float):
        options["type"] = kind
    elif get_origin(kind) is list and get_args(kind) == (str,):
        options["action"] = "append"
        options["help"] = f"{options['help'] or name} (repeatable)"
    elif kind is not str:
        raise TypeError(f"JobParams.{name}: no flag for {info.annotation}; write it by hand")
    target.add_argument(flag_name(name), *FLAG_ALIASES.get(name, ()), **options)


def add_field_flags(target: Any, names: tuple[str, ...], help: dict[str, str] | None = None) -> None:
    for name in names:
        add_field_flag(target, name, (help or {}).get(name))


def add_job_param_args(parser: argparse.ArgumentParser) -> None:
    """Every job parameter as a flag (`freight run`, `freight submit`)."""
    group = parser.add_argument_group("job parameters")
    group.add_argument("--params", help="job parameters as a JSON object (flags below override it)")
    for name in JobParams.model_fields:
        if name == "metadata":
            group.add_argument(
                "--metadata", action="append", metavar="KEY=VALUE", help="job metadata (repeatable)"
            )
        elif name not in SUMMARIZE_TASK_FIELDS:
            add_field_flag(group, name)
    summarize_group = parser.add_argument_group("summarize task (--task summarize; see `freight summarize`)")
    add_field_flags(summarize_group, SUMMARIZE_TASK_FIELDS)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The job parameters given as flags (those not given are left out)."""
    payload = {name: value for name in flag_fields() if (value := getattr(args, name, None)) is not None}
    if payload.get("template"):
        # A shell argument cannot easily hold a newline: accept \n and \t escapes in --template.
        payload["template"] = payload["template"].replace("\\n", "\n").replace("\\t", "\t")
    return payload


def params_dict_from_args(args: argparse.Namespace) -> dict:
    payload = json.loads(args.params) if args.params else {}
    if not isinstance(payload, dict):
        raise InputError("--params must be a JSON object")
    payload.update(flag_values(args))
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InputError(f"--metadata takes KEY=VALUE, got {item!r}")
        payload.setdefault("metadata", {})[key] = value
    return payload


def params_from_args(args: argparse.Namespace) -> JobParams:
    return job_params(params_dict_from_args(args))
