"""Bounded JSON parsing: every JSON the API parses (request bodies, `params`, JSONL lines, json_schema
strings) goes through `parse_json`, which enforces the limits of one `JsonLimits` (the settings'
`json_limits`, FREIGHT_JSON_LIMITS) and the text rule (text_rule.py) before any value is used.

The limits are checked by the parser itself, not after it: the size before anything is read, the
nesting depth by a linear scan before the recursive decoder runs (so 10,000 levels are a refusal, not a
RecursionError), the digits of each number as the decoder meets it (before `int()` converts it), and
object keys (count and duplicates) as each object is built. Duplicate keys are refused: "last one wins"
would let two readers of one body see different values."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from jobs.domain.text_rule import tree_problem

# A JSON string literal (escapes included); what is left outside them is structure and scalars.
_STRING_LITERAL = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSE = np.frombuffer(b"]}", dtype=np.uint8)


class JsonLimits(BaseModel):
    """Limits of one parsed JSON document (FREIGHT_JSON_LIMITS, a JSON object, overrides them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes: int = Field(1024 * 1024, ge=2, description="size of the document in UTF-8 bytes")
    max_depth: int = Field(32, ge=1, description="arrays and objects nested in one another")
    max_number_chars: int = Field(40, ge=1, description="characters of one number (digits, sign, exponent)")
    max_keys: int = Field(10_000, ge=1, description="object keys in the whole document")


class JsonRefused(ValueError):
    """The document breaks a limit, is not JSON, or holds text that breaks the text rule. `limit` names
    the limit (max_depth, ...), "json" for a syntax error, or "text" for the text rule."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit


def parse_json(raw: str | bytes, where: str, limits: JsonLimits, *, allow_nul: bool = False) -> Any:
    """The parsed value of `raw`, or JsonRefused naming `where` and the limit. Strings (keys and values)
    follow the text rule; `allow_nul` lets NUL through (a JSONL line, whose prompt text may hold one: the
    fields stored from it are checked again where they are read)."""
    data = raw.encode("utf-8", errors="surrogatepass") if isinstance(raw, str) else raw
    if len(data) > limits.max_bytes:
        raise JsonRefused(
            f"{where} is {len(data)} bytes; the limit is {limits.max_bytes} (max_bytes)", "max_bytes"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonRefused(f"{where} is not UTF-8 text (byte {exc.start})", "text") from exc
    depth = _max_depth(data)
    if depth > limits.max_depth:
        raise JsonRefused(
            f"{where} nests arrays and objects {depth} deep; the limit is {limits.max_depth} (max_depth)",
            "max_depth",
        )
    keys = 0

    def number(kind: type) -> Any:
        def convert(literal: str) -> Any:
            if len(literal) > limits.max_number_chars:
                raise JsonRefused(
                    f"{where} has a number of {len(literal)} characters; the limit is "
                    f"{limits.max_number_chars} (max_number_chars)",
                    "max_number_chars",
                )
            return kind(literal)

        return convert

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal keys
        keys += len(items)
        if keys > limits.max_keys:
            raise JsonRefused(f"{where} has more than {limits.max_keys} object keys (max_keys)", "max_keys")
        result = dict(items)
        if len(result) != len(items):
            seen: set[str] = set()
            repeated = next(key for key, _ in items if key in seen or seen.add(key))
            raise JsonRefused(
                f"{where} repeats the key {json.dumps(repeated[:64])} in one object; send each key once",
                "duplicate_key",
            )
        return result

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_int=number(int), parse_float=number(float))
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"{where} is not valid JSON: {exc.msg} at character {exc.pos}", "json") from exc
    except RecursionError as exc:  # the depth scan makes this unreachable; kept as a 4xx all the same
        raise JsonRefused(f"{where} nests too deep (max_depth)", "max_depth") from exc
    problem = tree_problem(value, where, allow_nul=allow_nul)
    if problem is not None:
        raise JsonRefused(problem, "text")
    return value


def _max_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects, brackets inside string literals not counted. Linear:
    string literals are cut out by one regex, the brackets counted with numpy."""
    structure = _STRING_LITERAL.sub(b"", data)
    if not structure:
        return 0
    codes = np.frombuffer(structure, dtype=np.uint8)
    steps = np.isin(codes, _OPEN).astype(np.int32) - np.isin(codes, _CLOSE).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))
