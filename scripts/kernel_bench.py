"""Time the kernels at realistic shapes and print one JSON document.

  python scripts/kernel_bench.py --device cuda [--out DIR]   # each Triton kernel vs the torch path on CUDA
  python scripts/kernel_bench.py --device cpu [--out DIR]    # the CPU paths: decode chunk sizes, W8A8 vs bf16
  python scripts/kernel_bench.py --device cpu --ops small_batch   # the small-batch INT8 product's two AVX2 forms
  python scripts/kernel_bench.py --device cpu --ops amx_gemm      # the AMX tile GEMM vs oneDNN, a layer's products
  python scripts/kernel_bench.py --device cpu --ops greedy_head   # the fused greedy LM head vs logits + max
  python scripts/kernel_bench.py --device cpu --ops ceiling       # the tier's INT8/bf16 product ceiling, 1.7B shapes

Every case runs in its own try block: a failure is recorded in the JSON and the rest still run.
Times are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.decode_attention import paged_decode_attention_torch, paged_decode_attention_triton  # noqa: E402
from kernels.int8_linear import int8_linear_torch, int8_linear_triton  # noqa: E402
from kernels.kv_cache import write_kv_cache_torch, write_kv_cache_triton  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention_torch, paged_prefill_attention_triton  # noqa: E402
from kernels.quantize import quantize_weight_per_channel  # noqa: E402

# (name, num_heads, num_kv_heads, head_dim): the default model, and a Llama-3-8B-sized layer.
MODELS = [("smollm2-135m", 9, 3, 64), ("llama-8b", 32, 8, 128)]
BLOCK_SIZE = 16


def models_for(device: str) -> list[tuple[str, int, int, int]]:
    return MODELS if device == "cuda" else MODELS[:1]  # the CPU serves the small model


def time_ms(device: str, reps: int, fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    """Median milliseconds of fn(*args, **kwargs): triton's do_bench on CUDA, `reps` timed calls on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median"))
    fn(*args, **kwargs)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args, **kwargs)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def paged_cache(lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    """Random caches with shuffled blocks: (key_cache, value_cache, k_scale, v_scale, block_tables)."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    if dtype == torch.int8:
        caches = [torch.randint(-127, 128, shape, dtype=torch.int8, device=device) for _ in range(2)]
        scales = [torch.rand(shape[:3], device=device) * 0.02 for _ in range(2)]
    else:
        caches = [torch.randn(shape, device=device).to(dtype) for _ in range(2)]
        scales = [None, None]
    ids = torch.randperm(num_blocks, device=device).int()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = ids[start : start + count]
        start += count
    return (*caches, *scales, tables)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def decode_cases(device: str, quick: bool) -> list[dict]:
    cases = []
    for name, heads, kv_heads, head_dim in models_for(device):
        batch, ctx = (256, 600) if name == "smollm2-135m" else (64, 2048)
        for cache_dtype in (torch.int8, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            lens = torch.randint(ctx - 100, ctx + 101, (batch,), generator=gen).tolist()
            cache = paged_cache(lens, kv_heads, head_dim, cache_dtype, device)
            query = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
            context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            args = (query, cache[0], cache[1], cache[4], context_lens, 0.125, cache[2], cache[3])
            case = dict(
                op="decode", model=name, batch=batch, mean_ctx=sum(lens) / batch, cache=str(cache_dtype)
            )
            if device == "cuda":
                case["triton_ms"] = time_ms(device, 0, paged_decode_attention_triton, *args)
                case["torch_ms"] = time_ms(device, 0, paged_decode_attention_torch, *args)
                bytes_read = sum(lens) * kv_heads * head_dim * 2 * cache_dtype.itemsize
                case["triton_GBps"] = bytes_read / case["triton_ms"] / 1e6
                outputs = paged_decode_attention_triton(*args), paged_decode_attention_torch(*args)
                case["max_abs_diff"] = max_diff(*outputs)
            else:  # the CPU path's one tuning knob: how many sequences share a gather
                for chunk in (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 40):
                    case[f"torch_ms_chunk_{chunk}"] = time_ms(
                        device, 5 if quick else 15, paged_decode_attention_torch, *args, chunk_elements=chunk
                    )
            cases.append(case)
    return cases


def prefill_cases(device: str, quick: bool) -> list[dict]:
    cases = []
    shapes = (("8x512", [512] * 8, [512] * 8), ("4x256-after-768", [256] * 4, [1024] * 4))
    for name, heads, kv_heads, head_dim in models_for(device):
        for label, q_lens, seq_lens in shapes:
            cache = paged_cache(seq_lens, kv_heads, head_dim, torch.int8, device)
            query = torch.randn(sum(q_lens), heads, head_dim, device=device, dtype=torch.bfloat16)
            ends = torch.tensor(q_lens).cumsum(0).tolist()
            starts = torch.tensor([0, *ends], dtype=torch.int32, device=device)
            lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            args = (query, cache[0], cache[1], cache[4], starts, lens, 0.125, cache[2], cache[3])
            case = dict(op="prefill", model=name, shape=label, cache="torch.int8")
            case["torch_ms"] = time_ms(device, 3 if quick else 7, paged_prefill_attention_torch, *args)
            if device == "cuda":
                case["triton_ms"] = time_ms(device, 0, paged_prefill_attention_triton, *args)
                outputs = paged_prefill_attention_triton(*args), paged_prefill_attention_torch(*args)
                case["max_abs_diff"] = max_diff(*outputs)
            cases.append(case)
    return cases


def write_cases(device: str, quick: bool) -> list[dict]:
    cases = []
    for name, _, kv_heads, head_dim in models_for(device):
        for tokens in (256, 4096):
            num_blocks = 2 * tokens // BLOCK_SIZE
            shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
            key = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
            value = torch.randn_like(key)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:tokens]
            caches = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(2)]
            scales = [torch.zeros(shape[:3], device=device) for _ in range(2)]
            args = (key, value, caches[0], caches[1], slots, scales[0], scales[1])
            case = dict(op="write_kv_cache", model=name, tokens=tokens, cache="torch.int8")
            case["torch_ms"] = time_ms(device, 5 if quick else 20, write_kv_cache_torch, *args)
            if device == "cuda":
                case["triton_ms"] = time_ms(device, 0, write_kv_cache_triton, *args)
            cases.append(case)
    return cases


def linear_cases(device: str, quick: bool) -> list[dict]:
    cases = []
    reps = 5 if quick else 20
    shapes = [(576, 1536), (1536, 576)] + ([(4096, 14336)] if device == "cuda" else [])
    for K, N in shapes:
        w = torch.randn(N, K, device=device)
        w_bf16 = w.bfloat16()
        w_q, w_scale = quantize_weight_per_channel(w)  # [N, K]: pass w_q.t()
        for M in (32, 256, 1024) + ((4096,) if device == "cuda" else ()):
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            case = dict(op="int8_linear", M=M, K=K, N=N)
            case["bf16_matmul_ms"] = time_ms(device, reps, torch.matmul, x, w_bf16.t())
            case["int8_torch_ms"] = time_ms(device, reps, int8_linear_torch, x, w_q.t(), w_scale)
            if device == "cpu":
                w_kn = w_q.t().contiguous()  # the other weight layout
                case["int8_torch_ms_weight_KN_contiguous"] = time_ms(
                    device, reps, int8_linear_torch, x, w_kn, w_scale
                )
            else:
                case["int8_triton_ms"] = time_ms(device, 0, int8_linear_triton, x, w_q.t(), w_scale)
                case["max_abs_diff"] = max_diff(int8_linear_triton(x, w_q.t(), w_scale), x @ w_bf16.t())
            best_int8 = min(v for k, v in case.items() if k.startswith("int8_") and "_ms" in k)
            case["speedup_vs_bf16"] = case["bf16_matmul_ms"] / best_int8
            cases.append(case)
    return cases


def ceiling_cases(device: str, quick: bool) -> list[dict]:
    """The tier's matrix-product ceiling at a 1.7B model's layer shapes (hidden 2048, MLP 8192): giga
    multiply-adds per second of each INT8 product Freight can run (torch._int_mm's s8 x s8, oneDNN's u8 x s8
    qlinear with its activation quantization, and where the CPU has AMX-INT8 Freight's own tile GEMM with its
    quantization and epilogue) and of bfloat16/float32 matmul, at prefill-sized M. The largest INT8 rate is
    the ceiling a model's achieved rate is compared with (docs/benchmarks.md)."""
    from kernels import cpu_int8_gemm_amx
    from kernels.cpu_int8_linear import int8_linear_onednn, onednn_available, prepack_onednn

    cases = []
    reps = 3 if quick else 10
    for K, N in ((2048, 8192), (8192, 2048)):
        w = torch.randn(N, K, device=device)
        w_q, _ = quantize_weight_per_channel(w)  # [N, K]
        w_kn = w_q.t()
        packed = prepack_onednn(w) if device == "cpu" and onednn_available() else None
        amx = cpu_int8_gemm_amx.pack(w_q) if device == "cpu" and cpu_int8_gemm_amx.available() else None
        w_scale = torch.rand(N) * 0.01
        for M in (64, 256, 1024):
            x = torch.randn(M, K, device=device)
            x_q = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=device)
            gmac = M * K * N / 1e9
            case = dict(op="ceiling", M=M, K=K, N=N)
            case["int_mm_gmacs"] = gmac / (time_ms(device, reps, torch._int_mm, x_q, w_kn) / 1e3)
            if packed is not None:
                case["onednn_gmacs"] = gmac / (time_ms(device, reps, int8_linear_onednn, x, packed) / 1e3)
            if amx is not None:
                amx_linear = cpu_int8_gemm_amx.int8_linear_amx
                case["amx_gmacs"] = gmac / (time_ms(device, reps, amx_linear, x.bfloat16(), amx, w_scale) / 1e3)
            case["bf16_gmacs"] = gmac / (time_ms(device, reps, torch.matmul, x.bfloat16(), w.bfloat16().t()) / 1e3)
            case["fp32_gmacs"] = gmac / (time_ms(device, reps, torch.matmul, x, w.t()) / 1e3)
            cases.append({k: round(v, 1) if isinstance(v, float) else v for k, v in case.items()})
    return cases


def small_batch_cases(device: str, quick: bool) -> list[dict]:
    """The CPU small-batch INT8 product in each form this build runs (the same integers): the [N, K] codes with
    full-range weights (the sign form on AVX2, the 4 x 4 row tile on VNNI), the same with 7-bit codes and their
    row sums (the AVX2 unsigned form), and the VNNI tier's 16-column panels. Gemma 3's LM head and layer
    shapes."""
    from kernels.cpu_int8_small_batch import (
        SmallBatchWeights,
        available,
        int8_product,
        panels_available,
        prepare,
    )

    if device != "cpu" or not available():
        return []
    cases = []
    reps = 3 if quick else 5
    for N, K in ((262144, 640), (4096, 640), (640, 2048)):
        w_q = torch.randint(-63, 64, (N, K), dtype=torch.int8)
        forms = {"rows": SmallBatchWeights(N, K, codes=w_q), "rows_7bit_sums": prepare(w_q, "rows")}
        if panels_available():
            forms["panels"] = prepare(w_q, "panels")
        for M in (1, 16, 32, 64):
            x_q = torch.randint(-127, 128, (M, K), dtype=torch.int8)
            want = int8_product(x_q, forms["rows"])
            case = dict(op="int8_small_batch", M=M, K=K, N=N)
            for name, weights in forms.items():
                if not torch.equal(int8_product(x_q, weights), want):
                    raise AssertionError(f"{name} differs at M={M}, [N, K] = [{N}, {K}]")
                ms = time_ms(device, reps, int8_product, x_q, weights)
                case[f"{name}_ms"] = ms
                case[f"{name}_gmacs"] = M * N * K / 1e6 / ms
            cases.append(case)
    return cases


def _fused_picks(x: torch.Tensor, head: tuple, layout: str) -> torch.Tensor:
    from kernels.cpu_int8_small_batch import int8_argmax_small_batch

    return int8_argmax_small_batch(x, head[1][layout], head[0])[0]


def _onednn_picks(x: torch.Tensor, head: tuple) -> torch.Tensor:
    from kernels import cpu_int8_linear

    return cpu_int8_linear.int8_linear_onednn(x, head[2], None, torch.float32).max(-1).indices


def _small_batch_picks(x: torch.Tensor, head: tuple) -> torch.Tensor:
    from kernels.cpu_int8_small_batch import int8_linear_small_batch

    return int8_linear_small_batch(x, head[1]["rows"], head[0], None, torch.float32).max(-1).indices


def greedy_head_cases(device: str, quick: bool) -> list[dict]:
    """A greedy step's LM head: the fused argmax (over the [N, K] codes, and over the VNNI tier's panels) against
    the [M, vocab] logits (oneDNN's qlinear or the small-batch product) and their max, on SmolLM2's and Gemma 3's
    heads, after checking the picks agree."""
    from kernels import cpu_int8_linear
    from kernels.cpu_int8_small_batch import available, panels_available, prepare

    if device != "cpu" or not (available() and cpu_int8_linear.onednn_available()):
        return []
    reps = 3 if quick else 5
    cases = []
    layouts = ["rows", "panels"] if panels_available() else ["rows"]
    for model, N, K in (("smollm2", 49152, 576), ("gemma3", 262144, 640)):
        w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K), cpu_int8_linear.weight_qmax())
        head = (w_scale, {layout: prepare(w_q, layout) for layout in layouts}, cpu_int8_linear.prepack_codes(w_q, w_scale))
        onednn, small = (partial(f, head=head) for f in (_onednn_picks, _small_batch_picks))
        for M in (1, 24, 64, 128, 256):
            x = torch.randn(M, K)
            case = dict(op="greedy_lm_head", model=model, M=M, K=K, N=N)
            for layout in layouts:
                fused = partial(_fused_picks, head=head, layout=layout)
                if not torch.equal(fused(x), onednn(x)):
                    raise AssertionError(f"the fused picks ({layout}) differ from the logits' max at M={M} ({model})")
                case[f"fused_{layout}_ms"] = time_ms(device, reps, fused, x)
                case[f"fused_{layout}_gmacs"] = M * N * K / 1e6 / case[f"fused_{layout}_ms"]
            case["onednn_max_ms"] = time_ms(device, reps, onednn, x)
            case["small_batch_max_ms"] = time_ms(device, reps, small, x)
            fastest_fused = min(case[f"fused_{layout}_ms"] for layout in layouts)
            case["speedup"] = min(case["onednn_max_ms"], case["small_batch_max_ms"]) / fastest_fused
            cases.append(case)
    return cases


def amx_gemm_cases(device: str, quick: bool) -> list[dict]:
    """One SmolLM2 layer's four W8A8 products (bfloat16 activations; quantization and epilogue included) on
    the AMX tile GEMM and on oneDNN's qlinear with our passes, after checking they agree bit for bit."""
    from kernels import cpu_int8_gemm_amx, cpu_int8_linear

    if device != "cpu" or not (cpu_int8_gemm_amx.available() and cpu_int8_linear.onednn_available()):
        return []
    reps = 5 if quick else 20
    layer = []  # (codes, scale, AMX weight, oneDNN weight, gated)
    for N, K in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K), cpu_int8_linear.weight_qmax())
        gated = N == 3072  # the gate/up product: SiLU-and-multiply fused
        tiles = cpu_int8_gemm_amx.pack_gated(w_q) if gated else cpu_int8_gemm_amx.pack(w_q)
        layer.append((w_q, w_scale, tiles, cpu_int8_linear.prepack_codes(w_q, w_scale), gated))

    def amx(xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [cpu_int8_gemm_amx.int8_linear_silu_mul_amx(xs[w.shape[1]], t, s) if g
                else cpu_int8_gemm_amx.int8_linear_amx(xs[w.shape[1]], t, s) for w, s, t, _, g in layer]  # fmt: skip

    def onednn(xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [cpu_int8_linear.int8_linear_silu_mul_onednn(xs[w.shape[1]], o) if g
                else cpu_int8_linear.int8_linear_onednn(xs[w.shape[1]], o) for w, _, _, o, g in layer]  # fmt: skip

    cases = []
    for M in (32, 129, 256, 512, 4096):
        xs = {K: torch.randn(M, K).bfloat16() for K in (576, 1536)}
        if not all(torch.equal(a, b) for a, b in zip(amx(xs), onednn(xs), strict=True)):
            raise AssertionError(f"the AMX GEMM and oneDNN disagree at M={M}")
        case = dict(op="int8_layer_amx_vs_onednn", M=M)
        case["amx_ms"] = time_ms(device, reps, amx, xs)
        case["onednn_ms"] = time_ms(device, reps, onednn, xs)
        case["speedup"] = case["onednn_ms"] / case["amx_ms"]
        cases.append(case)
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--out", type=Path, help="directory for kernel_bench_<device>.json")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--ops", default="decode,prefill,write,linear")
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "cases": [],
        "errors": [],
    }
    suites = dict(decode=decode_cases, prefill=prefill_cases, write=write_cases, linear=linear_cases,
                  small_batch=small_batch_cases, amx_gemm=amx_gemm_cases, greedy_head=greedy_head_cases,
                  ceiling=ceiling_cases)
    for op in args.ops.split(","):
        try:
            report["cases"].extend(suites[op](args.device, args.quick))
        except Exception:  # keep going: the other suites still tell something
            report["errors"].append({"op": op, "error": traceback.format_exc()})
        if args.device == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"kernel_bench_{args.device}.json").write_text(text)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
