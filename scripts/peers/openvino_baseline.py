"""OpenVINO GenAI as a peer of `freight bench`: its ContinuousBatchingPipeline over a workload Parquet.

Run it with the python of OpenVINO's venv (scripts/peers/setup.sh). Contract and report:
peer_common.py. The model is exported once with INT8 weights (`--convert HF --out DIR` runs
`optimum-cli export openvino --model HF --task text-generation-with-past --weight-format int8 DIR`,
which also writes the OpenVINO tokenizer the pipeline loads).

The whole workload goes to ContinuousBatchingPipeline.generate in one call, prompts as token-id
tensors, one GenerationConfig per request: greedy (do_sample False), max_new_tokens = min_new_tokens
= max_tokens with ignore_eos. Its scheduler (SchedulerConfig: max_num_seqs, max_num_batched_tokens,
dynamic split-fuse, prefix caching, a KV cache of --cache-size GB) batches continuously; the CPU
plugin runs INFERENCE_NUM_THREADS = the cores given, its default inference precision (bfloat16 where
the CPU has it) and KV cache precision.

Defaults (2 cores, AVX-512 + BF16 + VNNI, SmolLM2-135M, 2026-12-07): max_num_seqs 256,
max_num_batched_tokens 4096 (its own default is 256), dynamic split-fuse on, prefix caching on (off by
default), cache 4 GB: the settings of Freight's and vLLM's runs; not swept on a quiet machine yet.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from peer_common import Timer, Workload, convert_atomically, parser, report, run_or_convert


def convert(hf_folder: str, out: str) -> None:
    cli = Path(sys.executable).parent / "optimum-cli"

    def build(tmp: Path) -> None:
        subprocess.run([str(cli), "export", "openvino", "--model", hf_folder, "--task", "text-generation-with-past",
                        "--weight-format", "int8", str(tmp)], check=True)  # fmt: skip

    convert_atomically(out, build)


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise ValueError(f"expected on or off, got {value!r}")
    return value == "on"


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--cache-size", type=int, default=4, help="KV cache, GB")
    ap.add_argument("--prefix-caching", type=on_off, default=True, help="on or off (default on)")
    ap.add_argument("--split-fuse", type=on_off, default=True, help="dynamic split-fuse: on or off (default on)")
    run_or_convert(ap, convert, run)


def run(args: argparse.Namespace, workload: Workload, threads: int) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    scheduler = genai.SchedulerConfig()
    scheduler.max_num_seqs = args.max_num_seqs
    scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    scheduler.cache_size = args.cache_size
    scheduler.enable_prefix_caching = args.prefix_caching
    scheduler.dynamic_split_fuse = args.split_fuse
    properties = {"INFERENCE_NUM_THREADS": threads}
    timer = Timer()
    pipe = genai.ContinuousBatchingPipeline(args.model, scheduler, "CPU", properties)
    load_s = timer()

    configs = []
    for max_tokens in workload.max_tokens:
        config = genai.GenerationConfig()
        config.do_sample = False
        config.max_new_tokens = max_tokens
        config.min_new_tokens = max_tokens
        config.ignore_eos = True
        configs.append(config)
    inputs = [ov.Tensor(np.asarray([ids], dtype=np.int64)) for ids in workload.prompts]

    timer = Timer()
    results = pipe.generate(inputs, configs)
    elapsed = timer()
    outputs = [list(map(int, result.m_generation_ids[0])) for result in results]

    settings = {
        "engine": "openvino-genai",
        "openvino_genai": genai.__version__,
        "openvino": ov.__version__,
        "pipeline": "ContinuousBatchingPipeline",
        "weights": "int8",
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cache_size_gb": args.cache_size,
        "enable_prefix_caching": args.prefix_caching,
        "dynamic_split_fuse": args.split_fuse,
        "inference_num_threads": threads,
    }
    report(args, workload, outputs, elapsed, load_s, settings)


if __name__ == "__main__":
    main()
