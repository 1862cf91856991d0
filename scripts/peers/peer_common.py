"""What the peer baseline scripts share: their command line, the workload, the checks and the report.

Each baseline (ct2_baseline.py, openvino_baseline.py, llamacpp_baseline.py) runs with the python of
its peer's own venv (scripts/peers/setup.sh), never Freight's, so this module needs only the standard
library and pyarrow. The contract is the one of shared/bench/vllm_baseline.py, which `freight bench`
drives (worker/bench/peers.py):

    python X_baseline.py --workload W.parquet --model CONVERTED --report R.json --dump-tokens T.json
    python X_baseline.py --convert HF_FOLDER --out CONVERTED

The workload Parquet has id, prompt, prompt_token_ids, max_tokens. Prompts go in as token ids, decoding
is greedy and every request must produce exactly its max_tokens tokens with EOS ignored: a count that
differs fails the run (exit 3) rather than being reported. The report is one JSON line with the fields
of vLLM's (requests, prompt and output tokens, elapsed_s of generation alone, requests/s, total and
output tokens/s, load_s apart) plus the peer's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COUNT_MISMATCH_EXIT = 3


@dataclass
class Workload:
    ids: list[str]
    prompts: list[list[int]]
    max_tokens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)


def read_workload(path: str, limit: int = 0) -> Workload:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["id", "prompt_token_ids", "max_tokens"])
    ids = table.column("id").to_pylist()
    prompts = [list(map(int, p)) for p in table.column("prompt_token_ids").to_pylist()]
    max_tokens = [int(m) for m in table.column("max_tokens").to_pylist()]
    if limit:
        ids, prompts, max_tokens = ids[:limit], prompts[:limit], max_tokens[:limit]
    return Workload(ids, prompts, max_tokens)


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", help="workload Parquet (id, prompt, prompt_token_ids, max_tokens)")
    ap.add_argument("--model", help="the peer's converted model (what --convert wrote)")
    ap.add_argument("--report", default="", help="also write the JSON line here")
    ap.add_argument("--dump-tokens", default="", help='write {"id": [...], "output_token_ids": [[...]]} here')
    ap.add_argument("--threads", type=int, default=0, help="threads (default: every core this process may use)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests (0 = all)")
    ap.add_argument("--convert", metavar="HF_FOLDER", help="convert this HF folder to --out, then exit")
    ap.add_argument("--out", help="where --convert writes the converted model (a folder)")
    return ap


def threads_of(args: argparse.Namespace) -> int:
    return args.threads or len(os.sched_getaffinity(0))


def convert_atomically(out: str, build: Callable[[Path], None]) -> None:
    """Run build(tmp folder) and move the result to `out`, so a failed conversion leaves nothing there."""
    target = Path(out)
    if target.exists():
        raise SystemExit(f"{target} exists already")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    build(partial)
    partial.rename(target)


def check_counts(workload: Workload, outputs: Sequence[Sequence[int]], engine: str) -> None:
    """Every request must have exactly its max_tokens tokens; fail loudly (exit 3) otherwise."""
    if len(outputs) != len(workload):
        print(f"{engine}: {len(outputs)} outputs for {len(workload)} requests", file=sys.stderr)
        raise SystemExit(COUNT_MISMATCH_EXIT)
    wrong = [(i, len(o), m) for i, (o, m) in enumerate(zip(outputs, workload.max_tokens, strict=True)) if len(o) != m]
    if wrong:
        shown = ", ".join(f"request {i}: {got} tokens, not {want}" for i, got, want in wrong[:5])
        print(f"{engine}: {len(wrong)} requests with the wrong token count ({shown})", file=sys.stderr)
        raise SystemExit(COUNT_MISMATCH_EXIT)


def report(
    args: argparse.Namespace, workload: Workload, outputs: list[list[int]], elapsed: float, load_s: float,
    settings: dict[str, Any],
) -> None:
    """Check the counts, print the JSON line (and write --report) and dump the tokens."""
    check_counts(workload, outputs, settings.get("engine", "peer"))
    n = len(workload)
    prompt_tokens = sum(len(p) for p in workload.prompts)
    output_tokens = sum(len(o) for o in outputs)
    elapsed = max(elapsed, 1e-9)
    line = json.dumps({
        **settings,
        "model": args.model,
        "workload": args.workload,
        "requests": n,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(n / elapsed, 4),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "load_s": round(load_s, 3),
    })  # fmt: skip
    print(line, flush=True)
    if args.report:
        Path(args.report).write_text(line + "\n")
    if args.dump_tokens:
        Path(args.dump_tokens).write_text(json.dumps({"id": workload.ids, "output_token_ids": outputs}))


class Timer:
    """perf_counter seconds since construction."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.started


def require_run_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.convert:
        if not args.out:
            ap.error("--convert needs --out")
        return
    if not (args.workload and args.model):
        ap.error("--workload and --model are required (or --convert HF_FOLDER --out DIR)")


def run_or_convert(
    ap: argparse.ArgumentParser,
    convert: Callable[[str, str], None],
    run: Callable[[argparse.Namespace, Workload, int], None],
) -> None:
    """A runner's main: `--convert HF --out DIR` converts the model; otherwise run(args, workload, threads)."""
    args = ap.parse_args()
    require_run_args(ap, args)
    if args.convert:
        convert(args.convert, args.out)
        return
    run(args, read_workload(args.workload, args.limit), threads_of(args))
