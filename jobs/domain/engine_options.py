"""The engine's options, declared once: names, types, defaults, descriptions and checks.

Two readers need them and may not import each other: the engine (worker/engine/config.py builds its
`EngineConfig` on `EngineOptions`, adding the torch helpers) and the settings object
(jobs/domain/engine_settings.py derives the `FREIGHT_*` engine settings from the options marked `setting`,
and docs/configuration.md is generated from those). So this package imports the standard library only:
no torch, no pydantic, nothing of Freight's (tests/test_architecture.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # compute dtypes by name (torch's, in worker/engine/config.py)
INT8_BACKENDS = ("auto", "int_mm", "onednn", "amx")

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KvCacheDtype = Literal["int8", "auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "int8"] | None
Int8Backend = Literal["auto", "int_mm", "onednn", "amx"]


def option(default: Any, doc: str, *, setting: bool = True, ge: float | None = None, gt: float | None = None) -> Any:
    """A dataclass field with its description. setting: also a worker setting (`FREIGHT_<NAME>`; False for
    what each load decides: the model, its context, the device, the cache folder); ge/gt: the numeric bound
    the settings object enforces when it loads (the engine checks its own in __post_init__)."""
    bounds = {name: value for name, value in (("ge", ge), ("gt", gt)) if value is not None}
    return field(default=default, metadata={"doc": " ".join(doc.split()), "setting": setting, "bounds": bounds})


@dataclass
class EngineOptions:
    model: str = option(
        "smollm2-135m", "Alias of a known model, or a path to an HF folder / .gguf file.", setting=False
    )
    dtype: Dtype = option(
        "auto",
        "Compute dtype: `auto` (measured fastest at load, `plan/schemes.py`), `float32`, `bfloat16` or `float16`.",
    )
    quantization: Quantization = option(
        "auto",
        "Weights: `auto` (the INT8 scheme measured fastest on this machine (`plan/schemes.py`), or none), `int8` "
        "(W8A8) or `none`.",
    )
    int8_backend: Int8Backend = option(
        "auto",
        "CPU INT8 GEMM: `auto` (measured), `onednn`, `int_mm` or `amx` (Freight's own tile GEMM, CPUs with "
        "AMX-INT8; the same integers as the small-batch path, so its outputs equal `onednn`'s). Where two "
        "backends measure alike the pick, and with it the exact tokens, can differ between machines or fresh "
        "calibrations: pin it to rule that out.",
    )
    small_batch_rows: int | Literal["auto"] = option(
        "auto",
        "CPU INT8: products of at most this many rows run Freight's weight-streaming kernel; `auto`: measured, "
        "`0`: never.",
    )
    kv_cache_dtype: KvCacheDtype = option(
        "int8",
        "KV-cache dtype: `int8` (per-token, per-head scales), `auto` (the compute dtype) or a compute dtype.",
    )
    smoothing: bool = option(True, "INT8: SmoothQuant-style smoothing, calibrated at load (`smoothing.py`).")
    block_size: int = option(16, "Tokens per KV-cache block.", ge=1)
    # not a setting: the worker passes each model's own context, capped by FREIGHT_MAX_MODEL_LEN (settings.py)
    max_model_len: int = option(2048, "The engine's context, in tokens.", setting=False)
    max_num_seqs: int = option(256, "Most sequences in one engine step.", ge=1)
    max_num_batched_tokens: int = option(
        4096, "Most tokens in one engine step (decode rows plus prefill chunks).", ge=1
    )
    kv_cache_memory_gb: float = option(
        2.0, "KV-cache pool of the engine on CPU, in GB (on CUDA see `gpu_memory_utilization`).", gt=0
    )
    num_kv_blocks: int | None = option(
        None, "Exact KV pool size in blocks; overrides the memory budget.", setting=False
    )
    gpu_memory_utilization: float = option(
        0.85, "Fraction of free device memory for the KV pool on CUDA.", gt=0
    )
    scheduling: Literal["length", "fifo"] = option(
        "length",
        "Which waiting sequence a step admits first: `length` (fewest uncached prompt tokens) or `fifo`.",
    )
    enable_prefix_caching: bool = option(
        True,
        "Share the KV blocks of full blocks between sequences with a common prompt prefix (`block_manager.py`; "
        "an optimisation, on by default; off only to measure what it brings).",
    )
    enable_speculation: bool = option(
        True,
        "Prompt-lookup speculative decoding (`speculation.py`): drafts of up to `num_speculative_tokens` "
        "tokens where they pay (an optimisation, on by default; off only to measure what it brings).",
    )
    num_speculative_tokens: int = option(4, "Longest draft of prompt-lookup speculation, in tokens.", ge=0)
    speculation_max_rows: int | Literal["auto"] = option(
        "auto",
        "Speculate only in steps that feed at most this many rows; `auto`: rows priced by the small-batch "
        "measurement (`speculation.py`).",
    )
    batch_invariant_rows: int | Literal["auto"] = option(
        "auto",
        "Float projections in fixed blocks of this many rows, so a row's tokens do not depend on its batch "
        "(`quantization.FloatLinear`); `auto`: for unquantized float32 on CPU (the exact mode) the largest "
        "block at which this machine's GEMM rounds a row alike at every position (`invariance.py`), else 0.",
    )
    fused_greedy_head: bool = option(
        True,
        "INT8 on CPU: a step whose rows are all plain greedy (no logprobs, grammar or min_tokens ban) picks "
        "its tokens inside the LM head's product, never writing the [rows, vocab] logits.",
    )
    device: str | None = option(None, "`cuda` or `cpu`; unset: cuda when available.", setting=False)
    num_threads: int | None = option(None, "torch intra-op threads on CPU. Unset: torch's default.")
    cache_dir: str | None = option(
        None, "Where pulled models live; unset: `$FREIGHT_HOME/models`.", setting=False
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.quantization not in (None, "auto", "int8"):
            raise ValueError(f"quantization must be None, 'auto' or 'int8', got {self.quantization!r}")
        if self.int8_backend not in INT8_BACKENDS:
            raise ValueError(f"int8_backend must be 'auto', 'int_mm', 'onednn' or 'amx', got {self.int8_backend!r}")
        for name in ("small_batch_rows", "batch_invariant_rows", "speculation_max_rows"):
            value = getattr(self, name)
            if value != "auto" and not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name} must be 'auto' or an int >= 0, got {value!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.kv_cache_dtype not in ("int8", "auto", *DTYPE_NAMES):
            raise ValueError(f"kv_cache_dtype must be 'int8', 'auto' or a dtype, got {self.kv_cache_dtype!r}")
        if self.scheduling not in ("length", "fifo"):
            raise ValueError(f"scheduling must be 'length' or 'fifo', got {self.scheduling!r}")
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def setting_names() -> tuple[str, ...]:
    """The options that are also worker settings, in declaration order."""
    return tuple(f.name for f in fields(EngineOptions) if f.metadata["setting"])
