"""Engine configuration: what the user asks for, and the model's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # alias of the default model, or a path to an HF folder / .gguf file
    # "auto": the dtype and INT8 scheme measured fastest on this machine at load (path_plan.py)
    dtype: str = "auto"
    quantization: Literal["auto", "int8"] | None = "auto"
    int8_backend: Literal["auto", "int_mm", "onednn"] = "auto"  # CPU INT8 GEMM; "auto": measured
    # CPU INT8: products of at most this many rows run our weight-streaming kernel; "auto": measured, 0: never
    small_batch_rows: int | Literal["auto"] = "auto"
    kv_cache_dtype: str = "int8"  # "int8" or "auto" (= the compute dtype)
    smoothing: bool = True  # INT8: SmoothQuant-style smoothing, calibrated at load (smoothing.py)
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_cache_memory_gb: float = 2.0  # CPU pool size; on CUDA see gpu_memory_utilization
    num_kv_blocks: int | None = None  # exact pool size in blocks; overrides the memory budget
    gpu_memory_utilization: float = 0.85  # fraction of free device memory for the KV pool on CUDA
    scheduling: Literal["length", "fifo"] = "length"
    # share the KV of full blocks between sequences with the same prompt prefix (block_manager.py)
    enable_prefix_caching: bool = True
    # prompt-lookup speculative decoding (speculation.py): drafts of up to num_speculative_tokens tokens,
    # where they pay ("auto": rows priced by the small-batch measurement, speculation.py) or in steps that
    # feed at most speculation_max_rows rows
    enable_speculation: bool = True
    num_speculative_tokens: int = 4
    speculation_max_rows: int | Literal["auto"] = "auto"
    # float projections in fixed blocks of this many rows, so a row's tokens do not depend on its batch
    # (quantization.FloatLinear); "auto": for unquantized float32 on CPU (the exact mode) the largest block at
    # which this machine's GEMM rounds a row alike at every position (invariance.py; 16 where checked), else 0
    batch_invariant_rows: int | Literal["auto"] = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    cache_dir: str | None = None  # where pulled models live; None: $FREIGHT_HOME/models

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, "auto", "int8"):
            raise ValueError(f"quantization must be None, 'auto' or 'int8', got {self.quantization!r}")
        if self.int8_backend not in ("auto", "int_mm", "onednn"):
            raise ValueError(f"int8_backend must be 'auto', 'int_mm' or 'onednn', got {self.int8_backend!r}")
        if self.small_batch_rows != "auto" and not (isinstance(self.small_batch_rows, int) and self.small_batch_rows >= 0):
            raise ValueError(f"small_batch_rows must be 'auto' or an int >= 0, got {self.small_batch_rows!r}")
        if self.batch_invariant_rows != "auto" and not (
            isinstance(self.batch_invariant_rows, int) and self.batch_invariant_rows >= 0
        ):
            raise ValueError(f"batch_invariant_rows must be 'auto' or an int >= 0, got {self.batch_invariant_rows!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculation_max_rows != "auto" and not (
            isinstance(self.speculation_max_rows, int) and self.speculation_max_rows >= 0
        ):
            raise ValueError(f"speculation_max_rows must be 'auto' or an int >= 0, got {self.speculation_max_rows!r}")
        if self.kv_cache_dtype not in ("int8", "auto", *DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'int8', 'auto' or a dtype, got {self.kv_cache_dtype!r}")
        if self.scheduling not in ("length", "fifo"):
            raise ValueError(f"scheduling must be 'length' or 'fifo', got {self.scheduling!r}")
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def kv_torch_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype once the compute dtype is known ("auto" follows it)."""
        if self.kv_cache_dtype == "int8":
            return torch.int8
        if self.kv_cache_dtype == "auto":
            return compute_dtype
        return DTYPES[self.kv_cache_dtype]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    rope_scaling: dict | None = None  # HF rope_scaling ("llama3" and "linear" are applied)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Build from a transformers PretrainedConfig (LlamaConfig, MistralConfig, Qwen2Config)."""
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r}: Llama, Mistral and Qwen2 load")
        if model_type == "mistral" and getattr(hf_config, "sliding_window", None):
            raise ValueError("Mistral with a sliding window is not supported")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        rope_scaling = getattr(hf_config, "rope_scaling", None)
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        rope_theta = getattr(hf_config, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
