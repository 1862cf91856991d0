"""Where a row's prompt comes from (a prompt column, a messages column, or a template over columns),
and how one row becomes a prompt. Pure Python: shared by the validator and the worker."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

from jobs.domain.errors import InputError

PromptKind = Literal["prompt", "messages", "template"]
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PromptSource:
    kind: PromptKind
    columns: tuple[str, ...]  # input columns the prompt is built from
    template: str | None = None
    chat: bool = False  # apply the model's chat template

    def build(self, record: dict[str, Any]) -> tuple[str | Messages | None, str | None]:
        """(prompt, None) or (None, why this row has no usable prompt)."""
        if self.kind == "messages":
            return _messages(record.get(self.columns[0]))
        if self.kind == "template":
            missing = [name for name in self.columns if record.get(name) is None]
            if missing:
                return None, f"column {missing[0]!r} is null in this row"
            text = self.template.format_map({name: str(record[name]) for name in self.columns})
        else:
            text = record.get(self.columns[0])
            if text is None:
                return None, f"prompt column {self.columns[0]!r} is null"
        if not text.strip():
            return None, "empty prompt"
        if self.chat:
            return [{"role": "user", "content": text}], None
        return text, None


def _messages(value: Any) -> tuple[Messages | None, str | None]:
    if not value:
        return None, "messages is null or empty"
    messages = [{"role": m.get("role") or "", "content": m.get("content") or ""} for m in value]
    if not any(m["content"].strip() for m in messages):
        return None, "every message is empty"
    return messages, None


def template_fields(template: str) -> list[str]:
    """Column names a template uses; only plain `{name}` placeholders are allowed."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InputError(f"template is not valid: {exc}", field="template") from exc
    for _literal, name, format_spec, conversion in parsed:
        if name is None:
            continue
        if not name or name.isdigit() or any(char in name for char in ".[]"):
            raise InputError(
                f"template placeholder {{{name}}} must be a column name (no indexing, attributes or positions)",
                field="template",
            )
        if format_spec or conversion:
            raise InputError(
                f"template placeholder {{{name}}} must not have a format or conversion", field="template"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise InputError("template names no column: use placeholders like {text}", field="template")
    return names


def is_string_type(arrow_type: pa.DataType) -> bool:
    """A string column, plain or dictionary-encoded (an ordinary way pyarrow and Spark write strings:
    its values read as strings)."""
    if pa.types.is_dictionary(arrow_type):
        return is_string_type(arrow_type.value_type)
    return (
        pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or pa.types.is_string_view(arrow_type)
    )


def _is_template_type(arrow_type: pa.DataType) -> bool:
    """Scalar types whose values read as text in a prompt (and that Arrow casts to string)."""
    types = pa.types
    return (
        is_string_type(arrow_type)
        or types.is_integer(arrow_type)
        or types.is_floating(arrow_type)
        or types.is_boolean(arrow_type)
        or types.is_decimal(arrow_type)
        or types.is_date(arrow_type)
        or types.is_timestamp(arrow_type)
        or types.is_null(arrow_type)
    )


def _is_messages_type(arrow_type: pa.DataType) -> bool:
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    item = arrow_type.value_type
    if not pa.types.is_struct(item):
        return False
    fields = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(name in fields and is_string_type(fields[name]) for name in ("role", "content"))


def resolve_source(
    schema: pa.Schema, template: str | None, prompt_column: str | None, chat: bool | None
) -> PromptSource:
    """Decide how prompts are built for a file with this schema, or say clearly why they cannot be."""
    names = schema.names
    if template is not None:
        fields = template_fields(template)
        missing = [name for name in fields if name not in names]
        if missing:
            raise InputError(
                f"template names column(s) {missing} that the file does not have (columns: {names})",
                field="template",
            )
        for name in fields:
            arrow_type = schema.field(name).type
            if not _is_template_type(arrow_type):
                raise InputError(
                    f"column {name!r} has type {arrow_type}; a template needs text, numbers, booleans, "
                    "dates or timestamps",
                    column=name,
                )
        return PromptSource("template", tuple(fields), template=template, chat=True if chat is None else chat)
    column = prompt_column or ("prompt" if "prompt" in names else "messages" if "messages" in names else None)
    if column is None:
        raise InputError(
            f"no prompt: the file needs a 'prompt' string column or a 'messages' column, or the job a "
            f"template (columns: {names})"
        )
    if column not in names:
        raise InputError(f"prompt_column {column!r} is not in the file (columns: {names})", column=column)
    arrow_type = schema.field(column).type
    if column == "messages" and prompt_column is None or _is_messages_type(arrow_type):
        if not _is_messages_type(arrow_type):
            raise InputError(
                f"column 'messages' has type {arrow_type}; expected list<struct<role: string, content: string>>",
                column=column,
            )
        return PromptSource("messages", (column,), chat=True)
    if not is_string_type(arrow_type):
        raise InputError(f"column {column!r} has type {arrow_type}; expected string", column=column)
    return PromptSource("prompt", (column,), chat=bool(chat))
