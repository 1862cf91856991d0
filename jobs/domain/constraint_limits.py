"""Structural limits of structured-output constraints, checked before any grammar is compiled
(docs/input-rules.md). Compiling a grammar can take time far beyond its text's size (a schema nested a
few hundred levels, a bounded repetition of a bounded repetition), so what is cheap to measure is
measured first: schema nesting, subschemas, patterns and numeric bounds; regex length, group nesting,
repetition counts. What passes is compiled under a time budget (grammar_check.py).

A regular expression is held to one rule wherever it appears: a bare `regex` and a schema's `pattern`
(or `patternProperties` key) go through the same `regex_problem`, so a feature (a lookaround, say) is
refused the same way in both. The grammar engine would ignore a lookahead inside a schema pattern and
silently generate text that does not match; refusing it keeps "accepted" meaning "enforced"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jobs.domain.json_limits import JsonLimits

MAX_SCHEMA_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 24  # JSON nesting of the schema document
MAX_SCHEMA_NODES = 2000  # objects in the schema document (subschemas, property maps, ...)
MAX_SCHEMA_PATTERNS = 64
MAX_SCHEMA_BOUND = 10_000  # minLength, maxLength, minItems, maxItems, ... : each expands the grammar
MAX_REGEX_CHARS = 4096
MAX_REGEX_GROUP_DEPTH = 16
MAX_REGEX_REPEAT = 1000  # n and m of {n}, {n,}, {n,m}
BOUNDED_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
# How a json_schema string is parsed: the schema limits, whatever the request limits are.
SCHEMA_JSON_LIMITS = JsonLimits(
    max_bytes=MAX_SCHEMA_CHARS * 4, max_depth=MAX_SCHEMA_DEPTH, max_number_chars=40, max_keys=4 * MAX_SCHEMA_NODES
)
LOOKAROUNDS = {"(?=": "a lookahead", "(?!": "a negative lookahead", "(?<=": "a lookbehind", "(?<!": "a negative lookbehind"}


def schema_problem(schema: Any) -> str | None:
    """Why the parsed schema is over a structural limit (or holds a refused pattern), or None."""
    nodes = 0
    patterns = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}"
        if isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"has more than {MAX_SCHEMA_NODES} objects; simplify it"
        for keyword in BOUNDED_KEYWORDS:
            bound = node.get(keyword)
            if type(bound) is int and bound > MAX_SCHEMA_BOUND:
                return f"{keyword} is {bound}; the limit is {MAX_SCHEMA_BOUND}"
        for pattern in _patterns_of(node):
            patterns += 1
            if patterns > MAX_SCHEMA_PATTERNS:
                return f"has more than {MAX_SCHEMA_PATTERNS} patterns"
            problem = regex_problem(pattern)
            if problem is not None:
                return f"pattern {_short(pattern)}: {problem}"
        stack.extend((child, depth + 1) for child in node.values())
    return None


def schema_patterns(schema: Any) -> list[str]:
    """Every regular expression of the schema (`pattern` values, `patternProperties` keys), once each."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            found.update(dict.fromkeys(_patterns_of(node)))
            stack.extend(node.values())
    return list(found)


def _patterns_of(node: dict[str, Any]) -> Iterator[str]:
    if isinstance(node.get("pattern"), str):
        yield node["pattern"]
    if isinstance(node.get("patternProperties"), dict):
        yield from (key for key in node["patternProperties"] if isinstance(key, str))


def regex_problem(pattern: str) -> str | None:
    """Why a regular expression is over a structural limit or uses a feature refused everywhere (a
    lookaround), or None. A linear scan that knows escapes and character classes, so `\\(?=` and
    `[(?=]` are plain characters."""
    if len(pattern) > MAX_REGEX_CHARS:
        return f"is longer than {MAX_REGEX_CHARS} characters"
    depth = 0
    index = 0
    in_class = False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if in_class:
            if char == "]":
                in_class = False
            index += 1
            continue
        if char == "[":
            in_class = True
            index += 1
            if pattern.startswith("^", index):
                index += 1
            if pattern.startswith("]", index):  # a ] right after [ or [^ is a literal
                index += 1
            continue
        if char == "(":
            for opener, name in LOOKAROUNDS.items():
                if pattern.startswith(opener, index):
                    return f"uses {name} ({opener}...), which structured output cannot enforce"
            depth += 1
            if depth > MAX_REGEX_GROUP_DEPTH:
                return f"nests groups more than {MAX_REGEX_GROUP_DEPTH} deep"
        elif char == ")":
            depth = max(0, depth - 1)
        elif char == "{":
            close = pattern.find("}", index)
            bounds = pattern[index + 1 : close].split(",") if close > 0 else []
            if 1 <= len(bounds) <= 2 and all(part.strip().isdigit() or not part.strip() for part in bounds):
                numbers = [int(part) for part in bounds if part.strip()]
                if any(number > MAX_REGEX_REPEAT for number in numbers):
                    return f"repeats {max(numbers)} times; the limit of {{n,m}} is {MAX_REGEX_REPEAT}"
        index += 1
    return None


def _short(text: str) -> str:
    return repr(text if len(text) <= 60 else f"{text[:60]}...")
