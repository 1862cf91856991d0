"""The one text rule for every string a tenant sends (docs/input-rules.md).

- Every string must be valid Unicode: no lone surrogate (a JSON `\\ud800` escape that pairs with nothing)
  and, for bytes (Parquet cells, JSONL lines, multipart fields), valid UTF-8. Otherwise the request is a
  4xx naming where. Prompts included: a prompt that is not text is refused, never repaired, so the model
  always sees exactly what was sent.
- A NUL character is refused too wherever the string is stored in the database or becomes a key or an
  id (params, metadata, stop strings, templates, custom_id, file names, query parameters, batch bodies).
  Prompt text (prompt, template and messages cells, JSONL prompt and message content) may hold NUL: it
  is only ever read from the job's file and handed to the tokenizer.
- Reads never fail on what is stored: `repaired` renders a stored value whose text breaks the rule
  (rows written before the rule, or by hand) with U+FFFD in place of each lone surrogate.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.domain.errors import InputError

_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def text_problem(value: str, *, allow_nul: bool = False) -> str | None:
    """What breaks the rule in `value` ("contains a lone surrogate (U+D800) at character 3"), or None."""
    found = _SURROGATE.search(value)
    if found is not None:
        return f"contains a lone surrogate (U+{ord(found.group()):04X}) at character {found.start()}"
    if not allow_nul:
        index = value.find("\x00")
        if index >= 0:
            return f"contains a NUL character at character {index}, which cannot be stored"
    return None


def check_text(value: str, where: str, *, allow_nul: bool = False) -> str:
    """`value`, or a ValueError that names `where` (for pydantic validators and parsers)."""
    problem = text_problem(value, allow_nul=allow_nul)
    if problem is not None:
        raise ValueError(f"{where} {problem}")
    return value


def tree_problem(value: Any, where: str | None = None, *, allow_nul: bool = False) -> str | None:
    """The first string (object key or value, at any depth) of a parsed JSON value that breaks the rule,
    as "where: key[2].name contains ..." (no "where: " when `where` is None), or None. Iterative: the
    depth was bounded by the parser, but a caller may hand over anything."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        problem = None
        if isinstance(item, str):
            problem = text_problem(item, allow_nul=allow_nul)
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and text_problem(key, allow_nul=allow_nul) is not None:
                    problem = f"has a key that {text_problem(key, allow_nul=allow_nul)}"
                    break
                stack.append((child, f"{path}.{_printable(key)}" if path else _printable(key)))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{path}[{index}]") for index, child in enumerate(item))
        if problem is not None:
            subject = " ".join(part for part in (f"{where}:" if where and path else where, path) if part)
            return f"{subject or 'the value'} {problem}"
    return None


def _printable(key: Any) -> str:
    """A key as it may appear in a message: cut, and never a lone surrogate."""
    text = str(key)[:64]
    return _SURROGATE.sub(REPLACEMENT, text)


def repaired(value: Any) -> Any:
    """`value` (a stored JSON value or string) with each lone surrogate replaced by U+FFFD, so that it
    can always be rendered as UTF-8 JSON. Values that need no repair are returned as they are."""
    if isinstance(value, str):
        return _SURROGATE.sub(REPLACEMENT, value) if _SURROGATE.search(value) else value
    if isinstance(value, dict):
        return {repaired(key): repaired(child) for key, child in value.items()}
    if isinstance(value, list):
        return [repaired(child) for child in value]
    return value


# ---- Arrow columns (Parquet cells) -------------------------------------------------------------


def check_arrow_text(column: pa.Array, name: str, offset: int, *, allow_nul: bool) -> None:
    """Every cell of a string column (a batch starting at row `offset`) is valid UTF-8 and, unless
    `allow_nul`, free of NUL; else an InputError naming the row and column. Lists and structs of
    strings (messages, choice) are checked through their string children."""
    for strings, rows in _string_leaves(column):
        bad = _invalid_utf8_rows(strings)
        what = "is not valid UTF-8 text"
        if bad is None and not allow_nul:
            has_nul = pc.fill_null(pc.match_substring(strings, "\x00"), False).to_numpy(zero_copy_only=False)
            bad = int(np.argmax(has_nul)) if has_nul.any() else None
            what = "contains a NUL character, which cannot be stored"
        if bad is not None:
            row = offset + int(rows[bad]) if rows is not None else offset + bad
            raise InputError(f"row {row}: {name} {what}", row=row, column=name)


def _string_leaves(column: pa.Array) -> list[tuple[pa.Array, np.ndarray | None]]:
    """(string array, row of each of its values or None when it is the column itself) for each string
    array inside `column`."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column, pa.DictionaryArray):
        return [(column.dictionary_decode(), None)]
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return [(column, None)]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        leaves = []
        for strings, rows in _string_leaves(pc.list_flatten(column)):
            leaves.append((strings, parents if rows is None else parents[rows]))
        return leaves
    if pa.types.is_struct(kind):
        leaves = []
        for index in range(kind.num_fields):
            leaves.extend(_string_leaves(pc.struct_field(column, [index])))
        return leaves
    return []


def _invalid_utf8_rows(strings: pa.Array) -> int | None:
    """Index of the first value that is not valid UTF-8 (Parquet does not check), or None."""
    try:
        strings.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    for index, raw in enumerate(strings.cast(pa.binary()).to_pylist()):
        if raw is None:
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return index
    return None
