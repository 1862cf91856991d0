"""Which compute dtype and INT8 scheme this machine runs fastest, chosen by measurement at load.

The fastest choice depends on the CPU more than on anything else: with AVX-512 BF16 and VNNI, bfloat16
GEMMs and torch._int_mm run 2-3x float32; on an AVX2 machine bfloat16 runs 8x and torch._int_mm 50x
slower than float32, while oneDNN's u8 x s8 GEMM runs about 2x float32. So `dtype="auto"` and
`quantization="auto"` are settled by timing one decoder layer's projections and the LM head of the
model's real shapes (random weights) under each candidate scheme, at a prefill and a decode batch size.

Bounded: a first screen times one product per scheme and drops those over SCREEN_RATIO times the
fastest (a 50x-slow path would eat the budget); the rest get the full measurement. The result is cached
under $FREIGHT_HOME/calibration, keyed by CPU model, ISA tier, torch version, threads and model shape,
so later starts skip it. An explicit dtype or quantization is honoured; when the measurement saw it
slower than the best by more than SLOW_RATIO, a warning says by how much and what `auto` would pick.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kernels import (
    cpu_decode_attention,
    cpu_int8_gemm_amx,
    cpu_int8_linear,
    cpu_int8_small_batch,
    cpu_prefill_attention,
)
from kernels._cpu_build import CSRC
from kernels.platform import active_tier, amx_allowed, cpu_info
from worker.engine.attention import AttentionMetadata, KVCache
from worker.engine.attention_plan import AttentionChoice, choose_attention
from worker.engine.config import DTYPES, EngineConfig, ModelConfig
from worker.engine.model import DecoderModel
from worker.engine.quantization import Int8Backend
from worker.engine.small_batch_plan import SmallBatchChoice, choose_small_batch
from worker.engine.timing import ContentionMeter, best_seconds, store_measurement
from worker.engine.weights import canonical_shapes

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 2  # bump when the measurement changes meaning: older cache entries are ignored
# (2: the AVX2 small-batch product of 7-bit codes got faster, so where it wins moved)
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


@dataclass(frozen=True)
class Scheme:
    """Compute dtype of activations and float weights, and how projections are quantized."""

    dtype: str  # float32 | bfloat16 | float16
    quantization: str | None  # "int8" (W8A8) or None
    int8_backend: Int8Backend | None = None  # which INT8 GEMM, when quantized

    @property
    def name(self) -> str:
        return self.dtype if self.quantization is None else f"{self.dtype}+{self.quantization}/{self.int8_backend}"


@dataclass
class ExecutionPlan:
    """What the engine runs here, and why: the measured per-token seconds of every scheme tried."""

    tier: str
    scheme: Scheme
    head_dim: int
    source: str  # "measured", "cache" or "fixed" (CUDA, or nothing left to choose)
    seconds_per_token: dict[str, float] = field(default_factory=dict)  # scheme name -> model-level cost
    best: str | None = None  # the fastest scheme measured
    attention: AttentionChoice | None = None  # CPU: compiled kernel or torch, per attention op (measured)
    small_batch: SmallBatchChoice | None = None  # CPU INT8: up to which rows our own product runs (measured)

    def paths(self) -> dict[str, str]:
        """The path each op takes, by name (freight doctor, bench JSON, job metrics)."""
        s = self.scheme
        if s.quantization == "int8":
            gemm = {"int_mm": "W8A8 torch._int_mm (s8 x s8)", "onednn": "W8A8 oneDNN qlinear (u8 x s8)",
                    "amx": "W8A8 own AMX tile GEMM (s8 x s8, fused epilogue)",
                    "triton": "W8A8 Triton int8 GEMM"}[s.int8_backend or "int_mm"]  # fmt: skip
            quantize = "compiled per-token quantization" if cpu_int8_linear.available() else "torch"
            if self.small_batch is not None and self.small_batch.rows:
                tiles = ", AMX tiles" if cpu_int8_small_batch.amx_enabled() else ""
                gemm += f"; up to {self.small_batch.rows} rows: own weight-streaming int8 product ({self.tier}{tiles})"
        else:
            gemm, quantize = f"{s.dtype} GEMM", "none"
        if self.tier == "cuda":
            return {"dtype": s.dtype, "projections": gemm, "lm_head": gemm, "decode_attention": "triton",
                    "prefill_attention": "triton", "activation_quantization": "triton" if s.quantization else "none",
                    "epilogues": "triton"}  # fmt: skip
        return {
            "dtype": s.dtype,
            "projections": gemm,
            "lm_head": gemm,
            "decode_attention": f"compiled ({self.tier})" if self._compiled("decode") else "torch (gather + matmul)",
            "prefill_attention": self._prefill_attention_path(),
            "activation_quantization": quantize,
            "epilogues": f"compiled fused ({self.tier})" if s.quantization and cpu_int8_linear.available() else "torch",
        }  # fmt: skip

    def _prefill_attention_path(self) -> str:
        # the same test the dispatch makes (kernels/prefill_attention.py), on a one-token stand-in
        query = torch.empty(1, 1, self.head_dim, dtype=DTYPES[self.scheme.dtype])
        if self._compiled("prefill") and cpu_prefill_attention.supports(query, query):
            amx = self.scheme.dtype == "bfloat16" and self.head_dim == 64 and cpu_prefill_attention.amx_enabled()
            unit = "AMX tiles" if amx else self.tier
            return f"compiled flash attention ({unit}, {self.scheme.dtype}), cached prefixes included"
        return "torch SDPA per sequence"

    def _compiled(self, op: str) -> bool:
        if self.attention is not None:
            return self.attention.compiled_decode if op == "decode" else self.attention.compiled_prefill
        return op != "decode" or cpu_decode_attention.available()

    def to_json(self) -> dict[str, object]:
        attention = None if self.attention is None else self.attention.seconds
        small = None if self.small_batch is None else {"rows": self.small_batch.rows, "seconds": self.small_batch.seconds}
        return {"tier": self.tier, "scheme": self.scheme.name, "source": self.source, "best": self.best,
                "seconds_per_token": self.seconds_per_token, "attention_seconds": attention,
                "small_batch": small, "paths": self.paths()}  # fmt: skip


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


# On CUDA the Triton W8A8 GEMM beats a bfloat16 matmul only on wide layers: on an H200 (2026-12-04,
# scripts/kernel_bench.py) 1.14-1.61x at K=4096, N=14336 (Llama-8B's MLP), 0.09-0.70x at SmolLM2's
# K=576 / 1536 products, where the bfloat16 matmul takes microseconds and launch costs dominate.
CUDA_INT8_MIN_HIDDEN = 2048


def cuda_auto_quantization(model: ModelConfig) -> str | None:
    """quantization="auto" on CUDA: W8A8 for wide models, none for small ones (measured above)."""
    return "int8" if model.hidden_size >= CUDA_INT8_MIN_HIDDEN else None


def plan_for(config: EngineConfig, model: ModelConfig, device: torch.device, cache_dir: Path | None) -> ExecutionPlan:
    """Resolve config's "auto" choices on `device`; measure (or read the cache) on CPU."""
    if device.type == "cuda":
        dtype = "bfloat16" if config.dtype == "auto" else config.dtype
        quantization = cuda_auto_quantization(model) if config.quantization == "auto" else config.quantization
        scheme = Scheme(dtype, quantization, "triton" if quantization else None)
        return ExecutionPlan(tier="cuda", scheme=scheme, head_dim=model.head_dim, source="fixed")
    tier = active_tier()
    candidates = candidate_schemes(device)
    allowed = [s for s in candidates if _honours(s, config)]
    if not allowed:
        raise ValueError(f"no scheme runs dtype={config.dtype} quantization={config.quantization} "
                         f"int8_backend={config.int8_backend} here")  # fmt: skip
    path = None if cache_dir is None else cache_dir / f"{cache_key(model, config.max_num_seqs, config.kv_cache_dtype)}.json"
    timings = _read_cache(path, candidates)
    source = "cache"
    if timings is None and len(allowed) > 1:  # a choice to make: measure, one process at a time
        with _calibration_lock(path):
            timings = _read_cache(path, candidates)  # another process may have measured meanwhile
            if timings is None:
                timings, source = _measure_and_store(model, candidates, config, path), "measured"
    if timings is None:  # one explicit scheme and no measurement yet: nothing to choose or warn about
        return ExecutionPlan(tier=tier, scheme=allowed[0], head_dim=model.head_dim, source="fixed")
    best = min(timings, key=timings.__getitem__)
    chosen = pick_scheme(allowed, timings)
    ratio = timings.get(chosen.name, float("inf")) / timings[best]
    if ratio > SLOW_RATIO:
        log.warning(
            "dtype=%s quantization=%s runs %s here, measured %.1fx slower than %s; dtype='auto' and "
            "quantization='auto' would pick that", config.dtype, config.quantization, chosen.name, ratio, best,
        )
    return ExecutionPlan(tier=tier, scheme=chosen, head_dim=model.head_dim, source=source,
                         seconds_per_token=timings, best=best)  # fmt: skip


def pick_scheme(allowed: list[Scheme], timings: dict[str, float]) -> Scheme:
    """The fastest allowed scheme, except that INT8 weights win a tie (within TIE_RATIO) with none."""
    fastest = min(timings.get(s.name, float("inf")) for s in allowed)
    tied = [s for s in allowed if timings.get(s.name, float("inf")) <= fastest * TIE_RATIO]
    return min(tied, key=lambda s: (s.quantization is None, timings[s.name]))


def plan_cpu_kernels(plan: ExecutionPlan, config: EngineConfig, model: ModelConfig, cache_dir: Path | None) -> None:
    """Complete a CPU plan with the measured (or cached) kernel choices: compiled or torch attention, and
    up to which batch size the INT8 products run the small-batch kernel."""
    dtype = DTYPES[plan.scheme.dtype]
    kv_dtype = config.kv_torch_dtype(dtype)
    plan.attention = choose_attention(
        model, dtype, kv_dtype, attention_cache_file(cache_dir, model, config.max_num_seqs, dtype, kv_dtype)
    )
    if plan.scheme.quantization == "int8" and config.small_batch_rows == "auto":
        plan.small_batch = choose_small_batch(
            model, plan.scheme.dtype, plan.scheme.int8_backend or "int_mm",
            small_batch_cache_file(cache_dir, model, config.max_num_seqs, plan.scheme),
        )  # fmt: skip


def _honours(scheme: Scheme, config: EngineConfig) -> bool:
    if config.dtype != "auto" and scheme.dtype != config.dtype:
        return False
    if config.quantization == "auto":
        return True
    if scheme.quantization != config.quantization:
        return False
    return config.int8_backend in ("auto", scheme.int8_backend) or scheme.quantization is None


def cache_key(model: ModelConfig, max_num_seqs: int, kv_cache_dtype: str = "int8") -> str:
    info = cpu_info()
    parts = [CALIBRATION_VERSION, info.model_name, active_tier(), sorted(info.flags & _RELEVANT_FLAGS),
             torch.__version__, torch.get_num_threads(), model.hidden_size, model.intermediate_size,
             model.num_heads, model.num_kv_heads, model.head_dim, model.vocab_size, _decode_rows(max_num_seqs),
             cpu_int8_linear.available(), _kernel_sources_digest(), kv_cache_dtype, amx_allowed()]  # fmt: skip
    if model.num_experts:  # MoE shapes (dense models keep their keys)
        parts += [model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size, model.sparse_layers[:1]]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


@functools.cache
def _kernel_sources_digest() -> str:
    """Changed kernels measure again: the compiled sources are part of the cache key."""
    digest = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:12]


_RELEVANT_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"})


def attention_cache_file(
    cache_dir: Path | None, model: ModelConfig, max_num_seqs: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> Path | None:
    if cache_dir is None:
        return None
    names = str(dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch.")
    return cache_dir / f"{cache_key(model, max_num_seqs)}-attention-{names[0]}-{names[1]}.json"


def small_batch_cache_file(cache_dir: Path | None, model: ModelConfig, max_num_seqs: int, scheme: Scheme) -> Path | None:
    if cache_dir is None:
        return None
    return cache_dir / f"{cache_key(model, max_num_seqs)}-small-batch-{scheme.name.replace('/', '-')}.json"


def _decode_rows(max_num_seqs: int) -> int:
    return max(1, min(DECODE_TOKENS, max_num_seqs))


@contextlib.contextmanager
def _calibration_lock(path: Path | None) -> Iterator[None]:
    """Processes starting together (a worker pool) measure once and agree: the others wait, then read
    the cache. Measuring side by side would also slow every measurement down."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_cache(path: Path | None, candidates: list[Scheme]) -> dict[str, float] | None:
    if path is None or not path.is_file():
        return None
    try:
        cached = json.loads(path.read_text())["seconds_per_token"]
    except (OSError, ValueError, KeyError):
        log.warning("ignoring unreadable calibration cache %s", path)
        return None
    return cached if {s.name for s in candidates} <= cached.keys() else None


def _measure_and_store(
    model: ModelConfig, candidates: list[Scheme], config: EngineConfig, path: Path | None
) -> dict[str, float]:
    started = time.perf_counter()
    with ContentionMeter() as meter:
        timings = measure_schemes(model, candidates, decode_rows=_decode_rows(config.max_num_seqs),
                                  kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip
    log.info("calibrated %d schemes in %.1fs: %s", len(candidates), time.perf_counter() - started, timings)
    store_measurement(path, {"seconds_per_token": timings, "cpu": cpu_info().model_name, "tier": active_tier(),
                             "torch": torch.__version__, "threads": torch.get_num_threads()}, meter)  # fmt: skip
    return timings


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
