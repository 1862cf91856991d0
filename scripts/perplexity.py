"""Perplexity of a model on real text: transformers' own float32 forward against Freight's paths.

    .venv/bin/python scripts/perplexity.py --model gemma3-270m --texts 32 --max-len 1024

Texts are plain human turns from the ShareGPT package (no template), cut to --max-len tokens, those shorter
than --min-len dropped. Each path scores every token after the first of every text (prompt logprobs), so
the figures are comparable token for token. Prints one line per path and its ratio to Freight float32.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from worker.bench.perplexity import freight_perplexity, texts_for
from worker.engine import LLM
from worker.engine.loader import resolve_model_path

PATHS = {
    "freight float32": dict(dtype="float32", quantization=None, kv_cache_dtype="auto"),
    "freight bfloat16": dict(dtype="bfloat16", quantization=None, kv_cache_dtype="auto"),
    "freight W8A8 + INT8 KV (float32 activations)": dict(dtype="float32", quantization="int8", kv_cache_dtype="int8"),
    "freight defaults": dict(),
}


@torch.inference_mode()
def transformers_perplexity(model_dir, texts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for ids in texts:
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
        total += logprobs.sum().item()
        count += len(ids) - 1
    return math.exp(-total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from: {', '.join(PATHS)}")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' own forward")
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model)
    results: dict[str, float] = {}
    texts: list[list[int]] = []
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    if "freight float32" not in names or set(names) - PATHS.keys():
        parser.error(f"--paths must include 'freight float32' and name only: {', '.join(PATHS)}")
    for name in names:
        options = PATHS[name]
        started = time.perf_counter()
        llm = LLM(str(model_dir), max_model_len=max(2048, args.max_len + 1), **options)
        if not texts:
            texts = texts_for(llm.tokenizer, args.texts, args.min_len, args.max_len)
            print(f"{len(texts)} texts, {sum(map(len, texts))} tokens ({min(map(len, texts))}..{max(map(len, texts))} each)")
        results[name] = freight_perplexity(llm, texts)
        print(f"{name:48s} {results[name]:9.4f}  [{llm.engine.plan.scheme.name}]  {time.perf_counter() - started:.0f} s",
              flush=True)
        del llm
    if not args.no_transformers:
        results["transformers float32"] = transformers_perplexity(model_dir, texts)
        print(f"{'transformers float32':48s} {results['transformers float32']:9.4f}")
    base = results["freight float32"]
    for name, value in results.items():
        print(f"{name:48s} {value / base - 1:+.2%} vs freight float32")


if __name__ == "__main__":
    main()
