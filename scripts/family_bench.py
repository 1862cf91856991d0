"""Throughput per model family on random-weight models of real shapes (worker/bench/random_model.py).

For each named model, one `freight bench --model random:NAME --breakdown` run (Freight defaults, or the
systems given) on the ShareGPT workload, one after the other; then a markdown table: total and output
tokens/s, and the share of decode-step time in attention, MLP/experts, the q/k/v/o projections and the
rest, with the load average around each run (the machines are shared: compare rows run close together).

    python scripts/family_bench.py --n 32 --output-len 64 qwen3-0.6b gemma3-1b llama3.2-1b qwen3-moe-small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.random_model import FAMILIES  # noqa: E402
from worker.bench.run import main as bench_main  # noqa: E402


def run_one(name: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "bench.jsonl"
        argv = ["--model", f"random:{name}", "--systems", args.systems, "--n", str(args.n),
                "--output-len", str(args.output_len), "--breakdown", "--json-out", str(out), *args.bench_args]  # fmt: skip
        load_before = os.getloadavg()
        bench_main(argv)
        load_after = os.getloadavg()
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    machine = next(r["machine"] for r in records if "machine" in r)
    rows = []
    for record in records:
        if "system" not in record or "total_tokens_per_s" not in record:
            continue
        rows.append({"model": name, "machine": machine, "load": (load_before[0], load_after[0]), **record})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | system | requests | prompt + output tokens | total tok/s | output tok/s | decode steps "
            "| attention | MLP/experts | q/k/v/o proj | rest (of which outside forward) | draft acceptance "
            "| load avg before/after |")  # fmt: skip
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        b = r.get("decode_breakdown", {})
        s = b.get("shares", {})
        stats = r.get("engine_stats", {})
        drafted, accepted = stats.get("draft_tokens"), stats.get("accepted_draft_tokens")
        acceptance = f"{accepted}/{drafted}" if drafted is not None and accepted is not None else "-"
        pct = {key: f"{100 * s[key]:.1f}%" if key in s else "-" for key in
               ("attention", "mlp", "projections", "rest", "outside_forward")}  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['system']} | {r['requests']} | {r['prompt_tokens']:,} + {r['output_tokens']:,} "
            f"| {r['total_tokens_per_s']:.1f} | {r['output_tokens_per_s']:.1f} | {b.get('decode_steps', '-')} "
            f"| {pct['attention']} | {pct['mlp']} | {pct['projections']} | {pct['rest']} ({pct['outside_forward']}) "
            f"| {acceptance} | {r['load'][0]:.2f} / {r['load'][1]:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", default=list(FAMILIES), help=f"from {', '.join(FAMILIES)}")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--systems", default="freight", help="Freight systems of `freight bench` (no transformers)"
    )
    parser.add_argument(
        "--bench-args", nargs=argparse.REMAINDER, default=[], help="more `freight bench` arguments"
    )
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        rows += run_one(name, args)
        print(table(rows[-len(args.systems.split(",")) :]), flush=True)
    machine = rows[0]["machine"] if rows else {}
    print(f"\nmachine: {json.dumps(machine)}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
