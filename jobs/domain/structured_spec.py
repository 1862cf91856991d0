"""Structured output as the job domain sees it (no torch): which constraint a row's output follows.

A job sets at most one of `json_schema`, `regex`, `choice`; a row may override it with a non-null column
of the same name (at most one per row). The OpenAI surface's `response_format` maps onto the same spec
(`from_response_format`), and `as_columns` writes a spec as those row columns. The checks here are the
ones that need no grammar engine (the schema is a JSON object, the regex is non-empty, the choices are
non-empty strings). What the grammar engine itself refuses (an unsupported schema keyword, a regex
construct it lacks) is asked of it at submission through grammar_check.py (a child process: xgrammar
imports torch); where that cannot run, the worker finds it and fails only that row (worker/engine/structured.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from jobs.domain.constraint_limits import (
    MAX_SCHEMA_CHARS,
    SCHEMA_JSON_LIMITS,
    regex_problem,
    schema_problem,
)
from jobs.domain.json_limits import parse_json

STRUCTURED_COLUMNS = ("json_schema", "regex", "choice")
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
MAX_SCHEMA_NAME_CHARS = 64
JSON_OBJECT_SCHEMA = '{"type":"object"}'

StructuredKind = Literal["json_schema", "json_object", "regex", "choice"]


class StructuredSpec(BaseModel):
    """One constraint: json_schema (value: the schema's JSON text), json_object (any JSON object), regex
    (value: the pattern) or choice (value: the allowed outputs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: StructuredKind
    value: str | list[str] | None = None


def schema_text(value: Any, what: str = "json_schema") -> str:
    """A JSON schema (an object, or its JSON text) as compact JSON text, property order kept."""
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"{what} is longer than {MAX_SCHEMA_CHARS} characters")
        value = parse_json(value, what, SCHEMA_JSON_LIMITS)  # bounded: depth, numbers, keys, text
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object (a JSON schema), got {type(value).__name__}")
    problem = schema_problem(value)  # structural limits, before any grammar is compiled
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} is longer than {MAX_SCHEMA_CHARS} characters")
    return text


def check_regex(value: Any, what: str = "regex") -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    problem = regex_problem(value)  # the same rule as a schema's `pattern`
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    return value


def check_choice(value: Any, what: str = "choice") -> list[str]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ValueError(f"{what} must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"{what} has {len(value)} options; at most {MAX_CHOICES}")
    for option in value:
        if not isinstance(option, str) or not option or len(option) > MAX_CHOICE_CHARS:
            raise ValueError(f"each {what} option must be a string of 1 to {MAX_CHOICE_CHARS} characters")
    return list(value)


def from_params(json_schema: Any = None, regex: Any = None, choice: Any = None) -> StructuredSpec | None:
    """The job's (or a row's) constraint from the native fields; at most one may be set."""
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
             if value is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(f"set at most one of json_schema, regex and choice; got {' and '.join(given)}")
    if json_schema is not None:
        return StructuredSpec(kind="json_schema", value=schema_text(json_schema))
    if regex is not None:
        return StructuredSpec(kind="regex", value=check_regex(regex))
    if choice is not None:
        return StructuredSpec(kind="choice", value=check_choice(choice))
    return None


def from_response_format(response_format: Any) -> StructuredSpec | None:
    """OpenAI's `response_format` as a spec: {"type": "text"} (or none) is unconstrained,
    {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}} that schema. Raises ValueError with the field at fault. The output is always held to the
    schema strictly (no properties or items beyond those it names), whatever `strict` says."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise ValueError(f"response_format has unknown field(s): {', '.join(sorted(map(str, extra)))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(kind="json_object")
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be text, json_object or json_schema; got {kind!r}")
    body = response_format.get("json_schema")
    if not isinstance(body, Mapping):
        raise ValueError("response_format.json_schema must be an object with name and schema")
    unknown = set(body) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(
            f"response_format.json_schema has unknown field(s): {', '.join(sorted(map(str, unknown)))}"
        )
    name = body.get("name")
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= MAX_SCHEMA_NAME_CHARS
        or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
    ):
        raise ValueError(
            f"response_format.json_schema.name must be 1 to {MAX_SCHEMA_NAME_CHARS} characters of a-z, A-Z, "
            "0-9, _ and -"
        )
    if not isinstance(body.get("strict", False), bool | None):
        raise ValueError("response_format.json_schema.strict must be a boolean")
    schema = body.get("schema", {"type": "object"})
    return StructuredSpec(kind="json_schema", value=schema_text(schema, "response_format.json_schema.schema"))


def as_columns(spec: StructuredSpec | None) -> dict[str, Any]:
    """The native row columns that carry `spec` (json_object is the schema {"type": "object"})."""
    columns: dict[str, Any] = dict.fromkeys(STRUCTURED_COLUMNS)
    if spec is None:
        return columns
    if spec.kind == "json_object":
        columns["json_schema"] = JSON_OBJECT_SCHEMA
    else:
        columns[spec.kind] = spec.value
    return columns


def for_row(job: StructuredSpec | None, record: Mapping[str, Any]) -> StructuredSpec | None:
    """The row's constraint: its own non-null structured column, else the job's. The row's values were
    checked at submission (`check_row`); a json_schema column is passed on as its text, so that text the
    grammar engine cannot read fails that row alone."""
    given = [name for name in STRUCTURED_COLUMNS if record.get(name) is not None]
    if not given:
        return job
    name = given[0]
    value = record[name]
    if name == "json_schema":
        return StructuredSpec(
            kind="json_schema", value=value if isinstance(value, str) else json.dumps(value)
        )
    if name == "regex":
        return StructuredSpec(kind="regex", value=str(value))
    return StructuredSpec(kind="choice", value=[str(option) for option in value])


def check_row(record: Mapping[str, Any]) -> None:
    """The torch-free checks of one row's structured columns; ValueError names the column at fault."""
    from_params(*(record.get(name) for name in STRUCTURED_COLUMNS))


def check_column_types(schema: Any) -> tuple[str, ...]:
    """The input's structured columns (a pyarrow schema), each of the right type, else an InputError:
    json_schema and regex are strings, choice a list of strings."""
    import pyarrow as pa

    from jobs.domain.errors import InputError
    from jobs.domain.prompts import is_string_type

    names = tuple(name for name in STRUCTURED_COLUMNS if name in schema.names)
    for name in names:
        arrow_type = schema.field(name).type
        if name == "choice":
            ok = (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and is_string_type(
                arrow_type.value_type
            )
            expected = "list of strings"
        else:
            ok, expected = is_string_type(arrow_type), "string"
        if not ok:
            raise InputError(f"column {name!r} has type {arrow_type}; expected {expected}", column=name)
    return names


def check_column_values(
    batch: Any,
    names: tuple[str, ...],
    offset: int,
    refusal: Callable[[StructuredSpec], str | None] | None = None,
) -> None:
    """Each row's structured columns (a pyarrow record batch starting at row `offset`): at most one set,
    each well formed and (with `refusal`, the grammar engine's answer: grammar_check.py) accepted by the
    grammar engine, else an InputError naming the row and the column."""
    if not names:
        return
    from jobs.domain.errors import InputError

    # (column, value) seen good in this batch: a schema shared by many rows is parsed once
    checked: set[tuple[str, Any]] = set()
    for i, record in enumerate(batch.select(list(names)).to_pylist()):
        given = [(name, value) for name, value in record.items() if value is not None]
        if not given:
            continue
        key = given[0][0], tuple(given[0][1]) if isinstance(given[0][1], list) else given[0][1]
        if len(given) == 1 and key in checked:
            continue
        row = offset + i
        try:
            check_row(record)
        except ValueError as exc:
            raise InputError(f"row {row}: {exc}", row=row, column=given[-1][0]) from exc
        refused = refusal(for_row(None, record)) if refusal is not None else None
        if refused is not None:
            raise InputError(f"row {row}: {refused}", row=row, column=given[0][0])
        checked.add(key)
