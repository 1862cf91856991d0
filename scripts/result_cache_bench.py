"""The result cache on a rerun (docs/result-cache.md): a job of 10k greedy rows, then the same job with
10% of its rows changed, both through the embedded runner (`freight run`'s code: submit, shards,
finalize, SQLite), in a FREIGHT_HOME of its own (a temporary folder; the models cache is linked in).

    .venv/bin/python scripts/result_cache_bench.py [--rows 10000] [--changed 0.1] [--max-tokens 4]
        [--model tiny | smollm2-135m | PATH] [--dtype float32] [--quantization none]

`tiny` (the default) is a random-weight Llama of the tests' shape (2 layers, hidden 64) with SmolLM2's
tokenizer, built in the temporary home. The numerics default to the batch-invariant mode (float32, no
quantization): fixed, where `auto` is measured at each load and a busy machine can pick another
scheme for the rerun, which is another cache key.

Prints, for each run, the job's wall seconds (first shard started to finished: model load excluded)
and device seconds (engine busy time), the rerun's cached rows and saved device seconds, and the
rerun/first ratios (expected: about the changed share)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.domain.settings import Settings
from worker.embedded import run_embedded

TOPICS = ("rivers", "bridges", "owls", "comets", "glaciers", "orchards", "lighthouses", "volcanoes")


def prompts(rows: int, changed: float = 0.0) -> pa.Table:
    """Distinct prompts of a similar length; every round(1 / changed)-th row says something else."""
    every = round(1 / changed) if changed else 0
    texts = []
    for i in range(rows):
        topic = TOPICS[i % len(TOPICS)]
        if every and i % every == 0:
            texts.append(f"Entry {i}, revised: give one word that goes with {topic} at dusk.")
        else:
            texts.append(f"Entry {i}: give one word that goes with {topic} in the morning.")
    return pa.table({"custom_id": [f"row-{i}" for i in range(rows)], "prompt": texts})


def tiny_model(folder: Path, tokenizer_dir: Path) -> Path:
    """A seeded random-weight Llama (the tests' tiny shape) with the tokenizer of `tokenizer_dir`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--changed", type=float, default=0.1, help="share of rows changed in the rerun")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="freight-cache-bench-") as tmp:
        home = Path(tmp)
        models = Settings().home / "models"  # FREIGHT_HOME's, else the default home's
        if models.exists():
            (home / "models").symlink_to(models, target_is_directory=True)
        settings = Settings(home=home, data_dir=home / "data")
        model = str(tiny_model(home / "tiny", models / "smollm2-135m")) if args.model == "tiny" else args.model
        params = {
            "model": model,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
            "quantization": args.quantization,
        }
        runs = []
        for name, table in (("first run", prompts(args.rows)), ("rerun", prompts(args.rows, args.changed))):
            source = home / f"{name.replace(' ', '-')}.parquet"
            pq.write_table(table, source)
            started = time.monotonic()
            result = run_embedded(source, home / "out.parquet", params, settings)
            elapsed = time.monotonic() - started
            metrics = result.metrics
            assert result.status == "completed", result
            runs.append(metrics)
            print(
                f"{name}: {metrics['rows']} rows, wall {metrics['wall_seconds']:.2f} s, "
                f"device {metrics['device_seconds']:.2f} s, cached_rows {metrics['cached_rows']}, "
                f"saved device {metrics['saved_device_seconds']:.2f} s "
                f"(process {elapsed:.1f} s with model load)"
            )
        first, rerun = runs
        print(
            f"rerun / first: wall {rerun['wall_seconds'] / first['wall_seconds']:.3f}, "
            f"device {rerun['device_seconds'] / max(first['device_seconds'], 1e-9):.3f} "
            f"({args.changed:.0%} of rows changed)"
        )


if __name__ == "__main__":
    main()
