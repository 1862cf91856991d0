"""The engine end to end on a GPU: a random-weight Llama-3.1-8B-shaped model built on the device, bfloat16
and W8A8 + INT8 KV, many prompts with EOS ignored; prints one JSON document.

  python scripts/gpu_e2e.py --device cuda --out DIR          # the GPU stage of scripts/gpu_check.sh
  python scripts/gpu_e2e.py --dry-run                        # the same code on CPU with a tiny shape (CI)

Per scheme: output tokens/s over `--prompts` prompts of `--input-len` random token ids and `--output-len`
new tokens (stopped at `--max-seconds`, the rate then counts what was done), then the mean decode step at
each `--step-batches` batch (that many prompts of STEP_INPUT_LEN tokens, STEP_OUTPUT_LEN new ones; decode
steps only, timed around the engine's step, which ends in a device sync when tokens are read back) and the
bytes such a step must read: every linear weight once (the LM head included; the embedding only its rows)
and each sequence's KV so far. Bytes over step time is the achieved bandwidth, given as a share of the
card's HBM peak (PEAK_TBPS by device name, or --peak-tbps).

What the device lacks travels with it: scripts/gpu_carry.sh puts wheels in .whl and the tokenizer files in
.gpu_models (a random model copies a real model's tokenizer; weights need no download).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.breakdown import install as install_breakdown  # noqa: E402
from worker.bench.random_model import build_random_model  # noqa: E402
from worker.engine import LLM, SamplingParams  # noqa: E402
from worker.engine.config import ModelConfig  # noqa: E402
from worker.engine.parameters import parameter_counts  # noqa: E402

SHAPE = "llama3.1-8b"
# the dry run's shape: the same family and code path, seconds on 2 CPU cores
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128}  # fmt: skip
SCHEMES = {
    "bf16": {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "auto"},
    "w8a8-int8kv": {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8"},
}
STEP_INPUT_LEN, STEP_OUTPUT_LEN = 512, 64
PEAK_TBPS = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0}  # HBM peaks, TB/s (vendor figures)


def peak_tbps(device: str, override: float | None) -> float | None:
    if override is not None:
        return override
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tbps for key, tbps in PEAK_TBPS.items() if key in name), None)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def weight_bytes(config: ModelConfig, quantized: bool) -> float:
    """Bytes a decode step reads for the weights: every linear once (bf16: 2 bytes a weight; W8A8: 1, plus
    a float32 scale per output channel, counted as noise), not the embedding table (only its rows)."""
    linear = parameter_counts(config).total - config.vocab_size * config.hidden_size  # the embedding table
    return linear * (1 if quantized else 2)


def kv_bytes_per_token(config: ModelConfig, kv_int8: bool) -> float:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * (1 if kv_int8 else 2)


def run_scheme(model_dir: Path, name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    llm = LLM(str(model_dir), device=args.device, max_model_len=args.input_len + args.output_len + 16, **options)
    report: dict[str, Any] = {"scheme": name, "load_s": round(time.perf_counter() - started, 1)}
    config = llm.engine.model_config
    vocab = config.vocab_size

    # throughput: the whole prompt set, stopped at --max-seconds
    prompts = random_prompts(args.prompts, args.input_len, vocab, seed=1)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    before = llm.stats.output_tokens
    started, done = time.perf_counter(), 0
    for _ in llm.stream(prompts, params):
        done += 1
        if time.perf_counter() - started > args.max_seconds:
            break
    elapsed = time.perf_counter() - started
    output_tokens = llm.stats.output_tokens - before
    report["throughput"] = {
        "prompts": len(prompts), "finished": done, "stopped_at_limit": done < len(prompts),
        "output_tokens": output_tokens, "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
    }  # fmt: skip
    del llm  # the next engine gets the device's memory

    report["decode_steps"] = []
    for batch in args.step_batches:
        llm = LLM(str(model_dir), device=args.device, max_model_len=STEP_INPUT_LEN + STEP_OUTPUT_LEN + 16, **options)
        timers = install_breakdown(llm)
        step_prompts = random_prompts(batch, STEP_INPUT_LEN, vocab, seed=batch)
        llm.generate(step_prompts, SamplingParams(max_tokens=STEP_OUTPUT_LEN, temperature=0.0, ignore_eos=True))
        timed = timers.as_dict()
        step_s = timed["decode_seconds"] / max(timed["decode_steps"], 1)
        quantized = options["quantization"] == "int8"
        context = STEP_INPUT_LEN + STEP_OUTPUT_LEN / 2  # a decode step's mean context
        step_bytes = weight_bytes(config, quantized) + batch * context * kv_bytes_per_token(
            config, options["kv_cache_dtype"] == "int8"
        )
        entry = {
            "batch": batch, "decode_steps": timed["decode_steps"], "step_ms": round(step_s * 1e3, 3),
            "bytes_per_step": int(step_bytes), "achieved_tbps": round(step_bytes / step_s / 1e12, 3),
        }  # fmt: skip
        peak = peak_tbps(args.device, args.peak_tbps)
        if peak:
            entry["share_of_hbm_peak"] = round(entry["achieved_tbps"] / peak, 3)
        report["decode_steps"].append(entry)
        del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on CPU, few prompts: the CI check")
    parser.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-seconds", type=float, default=150.0, help="stop the throughput run here")
    parser.add_argument("--step-batches", type=lambda s: [int(b) for b in s.split(",")], default=[64, 256])
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--peak-tbps", type=float, default=None, help="the card's HBM peak (default: by name)")
    parser.add_argument("--models-dir", type=Path, default=Path(".gpu_models"),
                        help="where the tokenizer's model folder is and the random model is written")  # fmt: skip
    parser.add_argument("--out", type=Path, help="directory for gpu_e2e.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.prompts, args.input_len, args.output_len = min(args.prompts, 6), 24, 8
        args.step_batches = [2, 4]
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    overrides = TINY if args.dry_run else None
    model_dir = args.models_dir / (f"random-{SHAPE}" + ("-tiny" if args.dry_run else ""))
    started = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        build_random_model(SHAPE, model_dir, args.models_dir, overrides, device=args.device)
    report: dict[str, Any] = {
        "shape": SHAPE + (" (tiny, dry run)" if args.dry_run else ""),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "build_s": round(time.perf_counter() - started, 1),
        "workload": {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len},
        "schemes": [],
    }  # fmt: skip
    for name in args.schemes.split(","):
        report["schemes"].append(run_scheme(model_dir, name, SCHEMES[name], args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_e2e.json").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
