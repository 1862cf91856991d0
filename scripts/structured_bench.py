"""Structured extraction: how many outputs are valid JSON against a schema, with and without constraints,
and what the constraints cost.

    .venv/bin/python scripts/structured_bench.py [--rows 200] [--max-tokens 160] [--model smollm2-135m]

Each row asks the model to extract title, year, people, topic, word_count and a one-line summary as JSON
from a chunk of one of the project's sample documents (jobs/domain/sample_docs.py; nothing is
downloaded), through the chat template, greedy. The same rows run unconstrained, then constrained to the
schema (SamplingParams(structured=...), worker/engine/structured.py), in one engine, both warmed up
first. Prints, for each, the share of outputs that parse as JSON and the share that also validate against
the schema (jsonschema), rows finished by the model (stop) rather than by max_tokens, mean output
tokens, seconds, output tokens/s and total tokens/s; then the constrained/unconstrained throughput ratio
(output tokens/s: the runs write different lengths, so per-token rates compare the cost of a step).
"""

from __future__ import annotations

import argparse
import json
import random

import jsonschema

from jobs.domain.sample_docs import all_documents
from worker.bench.timed import timed_generate
from worker.engine import LLM, SamplingParams
from worker.engine.sampling_params import StructuredOutput

TOPICS = ["science", "history", "technology", "nature", "society", "arts", "business", "other"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "year": {"type": "integer", "minimum": 0, "maximum": 2100},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 6},
        "topic": {"type": "string", "enum": TOPICS},
        "word_count": {"type": "integer", "minimum": 0, "maximum": 100000},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "people", "topic", "word_count", "summary"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "Extract from the document below, as one JSON object and nothing else: title (a short title), year "
    "(the year it mentions, 0 if none), people (a list of the names of people it mentions), topic (one of "
    + ", ".join(TOPICS)
    + "), word_count (the number of words in the document) and summary (one sentence).\n\nDocument:\n{text}"
)


def chunks(rows: int, seed: int = 0) -> list[str]:
    """Row i: a 40-160-word run of one sample document (cycling through them), cut at word boundaries."""
    rng = random.Random(seed)
    docs = [text.split() for _, _, text in all_documents()]
    out = []
    for i in range(rows):
        words = docs[i % len(docs)]
        n = min(len(words), rng.randrange(40, 160))
        start = rng.randrange(0, len(words) - n + 1)
        out.append(" ".join(words[start : start + n]))
    return out


def prompts(llm: LLM, rows: int) -> list[list[int]]:
    return [
        llm.encode(
            llm.apply_chat_template([{"role": "user", "content": INSTRUCTION.format(text=text)}]),
            add_special_tokens=False,
        )
        for text in chunks(rows)
    ]


def verdict(text: str) -> tuple[bool, bool]:
    """(parses as JSON, and validates against the schema)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def warm_up(llm: LLM, batch: list[list[int]], params: SamplingParams) -> None:
    """First-call costs (kernel plans, the tokenizer's grammar view, the schema's compile) out of the timing."""
    llm.generate(batch[:8], SamplingParams(max_tokens=8, structured=params.structured))


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict[str, float]:
    timed = timed_generate(llm, batch, params)
    outs, seconds, output = timed.outputs, timed.seconds, timed.spent["output_tokens"]
    verdicts = [verdict(o.text) for o in outs]
    return {
        "parse": sum(p for p, _ in verdicts) / len(outs),
        "valid": sum(v for _, v in verdicts) / len(outs),
        "stopped": sum(o.finish_reason == "stop" for o in outs) / len(outs),
        "errors": sum(o.finish_reason == "error" for o in outs),
        "mean_output": output / len(outs),
        "seconds": seconds,
        "output_tokens_per_s": output / seconds,
        "tokens_per_s": timed.tokens_per_s,
        "example": outs[0].text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    llm = LLM(model=args.model)
    batch = prompts(llm, args.rows)
    runs = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens),
        "constrained": SamplingParams(max_tokens=args.max_tokens, structured=StructuredOutput.json(SCHEMA)),
    }
    for params in runs.values():
        warm_up(llm, batch, params)
    results = {name: run(llm, batch, params) for name, params in runs.items()}
    lengths = [len(p) for p in batch]
    print(f"{args.rows} rows, prompts {min(lengths)}-{max(lengths)} tokens "
          f"({sum(lengths) / len(lengths):.0f} mean), max_tokens {args.max_tokens}, "
          f"schema compiled {llm.engine.structured.compiles}x")  # fmt: skip
    for name, r in results.items():
        print(f"{name:>13}: parse {r['parse']:6.1%}  valid {r['valid']:6.1%}  stop {r['stopped']:6.1%}  "
              f"errors {r['errors']}  {r['mean_output']:6.1f} output tokens/row  {r['seconds']:7.2f} s  "
              f"{r['output_tokens_per_s']:8.1f} output tok/s  {r['tokens_per_s']:8.1f} tok/s")  # fmt: skip
    for name, r in results.items():
        print(f"{name:>13} example: {r['example'][:300]!r}")
    ratio = results["constrained"]["output_tokens_per_s"] / results["unconstrained"]["output_tokens_per_s"]
    total = results["constrained"]["tokens_per_s"] / results["unconstrained"]["tokens_per_s"]
    print(f"throughput constrained/unconstrained: {ratio:.2f}x output tokens/s, {total:.2f}x total tokens/s")


if __name__ == "__main__":
    main()
