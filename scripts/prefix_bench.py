"""Prefix caching on a batch job's shape: every row carries the same ~512-token instruction (system
prompt) and a unique 50-200-token document, through the chat template, greedy.

    .venv/bin/python scripts/prefix_bench.py [--rows 64] [--max-tokens 32] [--model smollm2-135m]

Runs the same rows with prefix caching off, then on (two engines, one process, each warmed up first)
and prints, for each, the share of prompt tokens served from the cache, computed tokens, seconds and
total (prompt + output) tokens per second, then the on/off ratio and whether the greedy outputs agree.
The documents are the project's sample texts (jobs/domain/sample_docs.py): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import random

from jobs.domain.sample_docs import DOCUMENTS, LONG_DOCUMENTS, SUMMARIZE_TEMPLATE, long_document_text
from worker.bench.timed import timed_generate
from worker.engine import LLM, SamplingParams


def instruction(llm: LLM, num_tokens: int) -> str:
    """A system prompt of about `num_tokens` tokens: house rules, then background cut to length."""
    rules = ("You are a careful analyst writing for a busy reader. Be faithful to the document, never invent "
             "facts, keep names and numbers exact, and write plain sentences. Background follows.\n\n")
    background = "\n".join(long_document_text(name) for _, _, name in LONG_DOCUMENTS)
    ids = llm.encode(rules + background, add_special_tokens=False)[:num_tokens]
    return llm.tokenizer.decode(ids)


def documents(rows: int, seed: int = 0) -> list[str]:
    """Unique documents of 40-150 words (about 50-200 tokens), each opened by its row number so that
    no two rows share anything after the instruction."""
    rng = random.Random(seed)
    words = " ".join(text for _, _, text in DOCUMENTS).split()
    out = []
    for i in range(rows):
        n = rng.randrange(40, 150)
        start = rng.randrange(0, len(words) - n)
        out.append(f"Document {i}: " + " ".join(words[start : start + n]))
    return out


def prompts(llm: LLM, rows: int, instruction_tokens: int) -> list[list[int]]:
    system = instruction(llm, instruction_tokens)
    return [
        llm.encode(llm.apply_chat_template([
            {"role": "system", "content": system},
            {"role": "user", "content": SUMMARIZE_TEMPLATE.format(text=doc)},
        ]), add_special_tokens=False)
        for doc in documents(rows)
    ]


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict[str, float]:
    llm.generate(batch[:2], SamplingParams(max_tokens=2))  # warm-up: first-call costs out of the timing
    timed = timed_generate(llm, batch, params)
    prompt = timed.spent["prompt_tokens"]
    return {
        "cached_share": timed.spent["cached_prompt_tokens"] / prompt,
        "computed_tokens": timed.spent["computed_tokens"],
        "seconds": timed.seconds,
        "tokens_per_s": timed.tokens_per_s,
        "outputs": [o.output_token_ids for o in timed.outputs],
        "prompt_tokens": prompt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--instruction-tokens", type=int, default=512)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLM(model=args.model, enable_prefix_caching=caching)
        batch = prompts(llm, args.rows, args.instruction_tokens)
        results[caching] = run(llm, batch, params)
        del llm
    lengths = [len(p) for p in batch]
    print(f"{args.rows} rows, prompts {min(lengths)}-{max(lengths)} tokens "
          f"({results[True]['prompt_tokens'] / args.rows:.0f} mean), {args.max_tokens} output tokens each")
    for caching, r in results.items():
        print(f"caching {'on ' if caching else 'off'}: cached {r['cached_share']:6.1%} of prompt tokens, "
              f"{r['computed_tokens']:7,} computed tokens, {r['seconds']:7.2f} s, {r['tokens_per_s']:8.1f} tokens/s")
    print(f"ratio on/off: {results[True]['tokens_per_s'] / results[False]['tokens_per_s']:.2f}x tokens/s")
    same = sum(a == b for a, b in zip(results[True]["outputs"], results[False]["outputs"], strict=True))
    print(f"greedy outputs identical: {same}/{args.rows} rows")


if __name__ == "__main__":
    main()
