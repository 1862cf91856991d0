"""Which compute dtype and INT8 scheme this machine runs fastest, chosen by measurement at load.

The fastest choice depends on the CPU more than on anything else: with AVX-512 BF16 and VNNI, bfloat16
GEMMs and torch._int_mm run 2-3x float32; on an AVX2 machine bfloat16 runs 8x and torch._int_mm 50x
slower than float32, while oneDNN's u8 x s8 GEMM runs about 2x float32. So `dtype="auto"` and
`quantization="auto"` are settled by timing one decoder layer's projections and the LM head of the
model's real shapes (random weights) under each candidate scheme, at a prefill and a decode batch size.

Bounded: a first screen times one product per scheme and drops those over SCREEN_RATIO times the
fastest (a 50x-slow path would eat the budget); the rest get the full measurement. The result is cached
(measure.py), so later starts skip it. An explicit dtype or quantization is honoured; when the measurement
saw it slower than the best by more than SLOW_RATIO, a warning says by how much and what `auto` would pick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels import cpu_int8_gemm_amx, cpu_int8_linear
from worker.engine.attention import AttentionMetadata, KVCache
from worker.engine.config import DTYPES, EngineConfig, ModelConfig
from worker.engine.model import DecoderModel
from worker.engine.plan.measure import CacheEntry
from worker.engine.plan.timing import best_seconds
from worker.engine.quantization import Int8Backend
from worker.engine.weights import canonical_shapes

log = logging.getLogger(__name__)

PREFILL_TOKENS = 256  # rows of the prefill-sized products
DECODE_TOKENS = 64  # rows of the decode-sized products (capped by max_num_seqs)
SCREEN_RATIO = 4.0  # a scheme this much slower than the fastest on the screen is not measured further
SLOW_RATIO = 1.2  # an explicit choice this much slower than auto's gets a warning
# Schemes measured within this ratio of the fastest are a tie between INT8 weights and none: two
# measurements of one scheme on a busy 2-core machine differ by as much, and INT8 weights leave more memory
# to KV blocks, so a tie goes to them. Among the tied, the fastest measured wins: on the AVX-512 (BF16)
# tier bfloat16 + W8A8 measured 3.5% under float32 + W8A8 and ran the 256-request bench 15% faster
# (959.6 vs 834.1 tokens/s, 2026-12-04), so a fixed preference for float32 cost more than noise does.
TIE_RATIO = 1.1
# On CUDA the Triton W8A8 GEMM beats a bfloat16 matmul only on wide layers: on an H200 (2026-12-04,
# scripts/kernel_bench.py) 1.14-1.61x at K=4096, N=14336 (Llama-8B's MLP), 0.09-0.70x at SmolLM2's
# K=576 / 1536 products, where the bfloat16 matmul takes microseconds and launch costs dominate.
CUDA_INT8_MIN_HIDDEN = 2048


@dataclass(frozen=True)
class Scheme:
    """Compute dtype of activations and float weights, and how projections are quantized."""

    dtype: str  # float32 | bfloat16 | float16
    quantization: str | None  # "int8" (W8A8) or None
    int8_backend: Int8Backend | None = None  # which INT8 GEMM, when quantized

    @property
    def name(self) -> str:
        return self.dtype if self.quantization is None else f"{self.dtype}+{self.quantization}/{self.int8_backend}"


@dataclass(frozen=True)
class SchemeChoice:
    scheme: Scheme
    source: str  # "measured", "cache" or "fixed" (CUDA, or nothing left to choose)
    seconds_per_token: dict[str, float]  # scheme name -> model-level cost ({} when fixed)
    best: str | None  # the fastest scheme measured


def candidate_schemes(device: torch.device) -> list[Scheme]:
    """Every scheme this machine can run."""
    dtypes = ["float32", "bfloat16"]
    backends: list[Int8Backend] = ["int_mm"]
    if device.type == "cpu" and cpu_int8_linear.onednn_available():
        backends.append("onednn")
    if device.type == "cpu" and cpu_int8_gemm_amx.available() and cpu_int8_linear.available():
        backends.append("amx")
    schemes = [Scheme(d, None) for d in dtypes]
    schemes += [Scheme(d, "int8", b) for d in dtypes for b in backends]
    return schemes


def cuda_auto_quantization(model: ModelConfig) -> str | None:
    """quantization="auto" on CUDA: W8A8 for wide models, none for small ones (measured above)."""
    return "int8" if model.hidden_size >= CUDA_INT8_MIN_HIDDEN else None


def decode_rows(max_num_seqs: int) -> int:
    return max(1, min(DECODE_TOKENS, max_num_seqs))


def choose_scheme(config: EngineConfig, model: ModelConfig, device: torch.device, entry: CacheEntry) -> SchemeChoice:
    """Resolve config's "auto" dtype and quantization on `device`: measured (or cached) on CPU."""
    if device.type == "cuda":
        dtype = "bfloat16" if config.dtype == "auto" else config.dtype
        quantization = cuda_auto_quantization(model) if config.quantization == "auto" else config.quantization
        return SchemeChoice(Scheme(dtype, quantization, "triton" if quantization else None), "fixed", {}, None)
    candidates = candidate_schemes(device)
    allowed = [s for s in candidates if _honours(s, config)]
    if not allowed:
        raise ValueError(f"no scheme runs dtype={config.dtype} quantization={config.quantization} "
                         f"int8_backend={config.int8_backend} here")  # fmt: skip

    def covers(seconds: dict[str, float]) -> bool:
        return {s.name for s in candidates} <= seconds.keys()

    timings, source = entry.cached(covers), "cache"
    if timings is None and len(allowed) > 1:  # a choice to make: measure (one process at a time)
        rows = decode_rows(config.max_num_seqs)
        measured = entry.measure(
            lambda: measure_schemes(model, candidates, decode_rows=rows, kv_cache_dtype=config.kv_cache_dtype), covers
        )
        timings, source = measured.seconds, measured.source
    if timings is None:  # one explicit scheme and no measurement yet: nothing to choose or warn about
        return SchemeChoice(allowed[0], "fixed", {}, None)
    best = min(timings, key=timings.__getitem__)
    chosen = pick_scheme(allowed, timings)
    ratio = timings.get(chosen.name, float("inf")) / timings[best]
    if ratio > SLOW_RATIO:
        log.warning(
            "dtype=%s quantization=%s runs %s here, measured %.1fx slower than %s; dtype='auto' and "
            "quantization='auto' would pick that", config.dtype, config.quantization, chosen.name, ratio, best,
        )
    return SchemeChoice(chosen, source, timings, best)


def pick_scheme(allowed: list[Scheme], timings: dict[str, float]) -> Scheme:
    """The fastest allowed scheme, except that INT8 weights win a tie (within TIE_RATIO) with none."""
    fastest = min(timings.get(s.name, float("inf")) for s in allowed)
    tied = [s for s in allowed if timings.get(s.name, float("inf")) <= fastest * TIE_RATIO]
    return min(tied, key=lambda s: (s.quantization is None, timings[s.name]))


def _honours(scheme: Scheme, config: EngineConfig) -> bool:
    if config.dtype != "auto" and scheme.dtype != config.dtype:
        return False
    if config.quantization == "auto":
        return True
    if scheme.quantization != config.quantization:
        return False
    return config.int8_backend in ("auto", scheme.int8_backend) or scheme.quantization is None


HEAD_VOCAB = 8192  # the timed model's vocabulary; LM head time is scaled to the real one (linear in N)
CONTEXT = 128  # tokens per sequence of the timed steps
BLOCK = 16  # KV block size of the timed cache


class _OneLayer:
    """A one-layer DecoderModel of the real layer shapes (random weights) in one scheme, with a filled KV
    cache: times a whole layer (norms, RoPE, attention, projections) at prefill and decode sizes, since
    a dtype's cost is not only its GEMMs (bfloat16 norms and attention are slow without AVX-512 BF16)."""

    def __init__(self, model: ModelConfig, scheme: Scheme, kv_dtype: torch.dtype, rows: int, gen: torch.Generator):
        self.dtype = DTYPES[scheme.dtype]
        self.config = replace(model, num_layers=1, vocab_size=min(model.vocab_size, HEAD_VOCAB))
        self.head_scale = model.vocab_size / self.config.vocab_size
        tensors = {name: torch.randn(shape, generator=gen) * (shape[-1] ** -0.5 if len(shape) >= 2 else 1.0)
                   for name, shape in canonical_shapes(self.config).items()}  # fmt: skip
        cpu = torch.device("cpu")
        self.model = DecoderModel(self.config, tensors, self.dtype, scheme.quantization, cpu, max_positions=CONTEXT,
                                int8_backend=scheme.int8_backend)  # fmt: skip
        self.seqs = max(rows, PREFILL_TOKENS // CONTEXT)
        blocks = -(-CONTEXT // BLOCK)
        self.cache = KVCache(self.config, self.seqs * blocks, BLOCK, kv_dtype, cpu)
        for pool in (self.cache.keys, self.cache.values):
            pool.copy_(torch.randint(-100, 100, pool.shape, generator=gen) if kv_dtype == torch.int8
                       else torch.randn(pool.shape, generator=gen))  # fmt: skip
        self.tables = torch.arange(self.seqs * blocks, dtype=torch.int32).view(self.seqs, blocks)
        self.gen = gen

    def prefill(self) -> Callable[[], object]:
        n = PREFILL_TOKENS // CONTEXT
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n * CONTEXT), num_decode_tokens=0, decode_block_tables=None,
            decode_context_lens=None, prefill_block_tables=self.tables[:n],
            prefill_query_start_loc=torch.arange(0, n * CONTEXT + 1, CONTEXT, dtype=torch.int32),
            prefill_seq_lens=torch.full((n,), CONTEXT, dtype=torch.int32),
        )  # fmt: skip
        return self._forward(torch.arange(CONTEXT).repeat(n), meta)

    def decode(self, rows: int) -> Callable[[], object]:
        per_seq = self.tables.shape[1] * BLOCK
        meta = AttentionMetadata(
            slot_mapping=torch.arange(rows) * per_seq + CONTEXT - 1, num_decode_tokens=rows,
            decode_block_tables=self.tables[:rows], decode_context_lens=torch.full((rows,), CONTEXT, dtype=torch.int32),
            prefill_block_tables=None, prefill_query_start_loc=None, prefill_seq_lens=None,
        )  # fmt: skip
        return self._forward(torch.full((rows,), CONTEXT - 1), meta)

    def head(self, rows: int) -> Callable[[], object]:
        hidden = torch.randn(rows, self.config.hidden_size, generator=self.gen).to(self.dtype)
        return lambda: self.model.logits(hidden)

    def _forward(self, positions: torch.Tensor, meta: AttentionMetadata) -> Callable[[], object]:
        ids = torch.randint(0, self.config.vocab_size, positions.shape, generator=self.gen)
        return lambda: self.model.forward(ids, positions, meta, self.cache)


@torch.inference_mode()
def measure_schemes(
    model: ModelConfig, candidates: list[Scheme], *, decode_rows: int, kv_cache_dtype: str = "int8"
) -> dict[str, float]:
    """Model-level seconds per token of each scheme: the mean of a prefill token (every layer at
    PREFILL_TOKENS rows) and a decode token (every layer plus the LM head at decode_rows rows).

    Schemes are built one at a time. Each is first screened on one decode step; one over SCREEN_RATIO
    times the fastest screen so far keeps the screen's extrapolation instead of the longer timings (a
    path 50x slower than float32 exists on AVX2)."""
    gen = torch.Generator().manual_seed(0)
    kv_config = EngineConfig(model="unused", kv_cache_dtype=kv_cache_dtype)
    timings: dict[str, float] = {}
    fastest_screen = float("inf")
    for scheme in candidates:
        layer = _OneLayer(model, scheme, kv_config.kv_torch_dtype(DTYPES[scheme.dtype]), decode_rows, gen)
        decode_step = layer.decode(decode_rows)
        screen = best_seconds(decode_step, limit=0.0)
        fastest_screen = min(fastest_screen, screen)
        if screen > SCREEN_RATIO * fastest_screen:
            timings[scheme.name] = model.num_layers * screen / decode_rows
            continue
        decode = model.num_layers * best_seconds(decode_step)
        decode += layer.head_scale * best_seconds(layer.head(decode_rows))
        prefill = model.num_layers * best_seconds(layer.prefill()) / PREFILL_TOKENS
        timings[scheme.name] = (prefill + decode / decode_rows) / 2
    return timings
