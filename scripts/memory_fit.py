"""Does a model's KV cache for `--seqs` sequences of `--context` tokens fit beside its weights? Loads the engine
with that budget, commits every page of the KV pool (the engine allocates it lazily), and prints one JSON line:
the pool's capacity in tokens, the peak RSS during load and the RSS with the pool committed, and what is left.

  python scripts/memory_fit.py --model random:smollm2-1.7b --seqs 64 --context 2048 --kv-cache-memory-gb 14
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.random_model import PREFIX, random_model_path  # noqa: E402
from worker.engine import LLM, SamplingParams  # noqa: E402

GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-gb", type=float, required=True)
    args = parser.parse_args()
    model = str(random_model_path(args.model, None)) if args.model.startswith(PREFIX) else args.model
    started = time.perf_counter()
    llm = LLM(model, max_num_seqs=args.seqs, max_model_len=args.context, kv_cache_memory_gb=args.kv_cache_memory_gb)
    load_s = time.perf_counter() - started
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = llm.engine
    for pool in engine.kv_cache.pools:  # commit the pool's pages: what a full batch would touch
        for tensor in (pool.keys, pool.values, pool.key_scales, pool.value_scales):
            if tensor is not None:
                tensor.zero_()
    tokens = engine.kv_blocks.groups[0].num_blocks * engine.config.block_size  # full-attention layers' pool
    out = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    vm = psutil.virtual_memory()
    print(json.dumps({
        "model": args.model, "plan": engine.plan.scheme.dtype + "+" + str(engine.plan.scheme.quantization),
        "kv_dtype": str(engine.kv_dtype), "pool_tokens": tokens, "wanted_tokens": args.seqs * args.context,
        "fits": tokens >= args.seqs * args.context and not engine.context_cut,
        "load_s": round(load_s, 1), "load_peak_rss_gib": round(load_peak / GIB, 2),
        "rss_with_pool_gib": round(psutil.Process().memory_info().rss / GIB, 2),
        "machine_total_gib": round(vm.total / GIB, 1), "machine_available_gib": round(vm.available / GIB, 1),
        "generated": len(out[0].output_token_ids),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
