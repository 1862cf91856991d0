"""`freight-grammar-check` (pyproject.toml's entry point for `main`): answers, one JSON line per JSON line, whether the grammar engine
accepts a structured-output constraint, so that the API (which never imports torch, and xgrammar does) can
refuse a schema at submission in a child process (jobs/domain/grammar_check.py).

In:  {"kind": "json_schema" | "json_object" | "regex" | "choice", "value": ...}
Out: {"refusal": null} or {"refusal": "<kind> refused by the grammar engine: <reason>"}
The grammar is built exactly as an engine builds it (structured.py grammar_for), without a tokenizer.

It also counts a quote's exact prompt tokens with the model's tokenizer (token_count.py):
In:  {"count_tokens": {...}}   Out: {"tokens": [...]} or {"error": "..."}
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from worker.engine.sampling_params import StructuredOutput
from worker.engine.structured import grammar_for, refusal_message
from worker.engine.token_count import Tokenizers, count_tokens


def refusal(request: dict) -> str | None:
    try:
        spec = StructuredOutput(request["kind"], request.get("value"))
    except (KeyError, ValueError) as exc:
        return f"not a structured-output constraint: {exc}"
    try:
        grammar_for(spec)
    except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) with its reason
        return refusal_message(spec, exc)
    return None


def serve(lines: TextIO, out: TextIO) -> None:
    tokenizers = Tokenizers()  # loaded on the first count for each model, kept for the next quotes
    for line in lines:
        try:
            request = json.loads(line)
            if isinstance(request, dict) and isinstance(request.get("count_tokens"), dict):
                answer = count_tokens(request["count_tokens"], tokenizers)
            else:
                answer = {"refusal": refusal(request) if isinstance(request, dict) else "not a JSON object"}
        except json.JSONDecodeError as exc:
            answer = {"refusal": f"not JSON: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def main() -> None:
    import xgrammar  # noqa: F401  (imported before the ready line, so the first answer is not slow)

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
