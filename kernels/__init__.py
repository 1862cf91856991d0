"""Attention, KV-cache and INT8 ops of the inference engine.

Each op checks its arguments, then dispatches by one rule (kernels/_dispatch.py, select_backend): a
Triton kernel for CUDA tensors (when triton is installed), the compiled CPU kernel for CPU tensors (when it
is available and supports the inputs, unless disabled), a torch implementation otherwise.
kernels/reference.py holds the slow references the tests compare against.
Importing this package needs neither triton nor CUDA.
"""

from kernels.platform import apply_forced_tier_environment

apply_forced_tier_environment()  # before any torch op: the libraries read their ISA limits once

from kernels._dispatch import select_backend  # noqa: E402
from kernels.decode_attention import paged_decode_attention  # noqa: E402
from kernels.int8_linear import int8_linear, int8_linear_silu_mul, quantize_per_token  # noqa: E402
from kernels.kv_cache import write_kv_cache  # noqa: E402
from kernels.norm import rms_norm  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from kernels.quantize import quantize_weight_per_channel  # noqa: E402

__all__ = [
    "int8_linear",
    "int8_linear_silu_mul",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_per_token",
    "quantize_weight_per_channel",
    "rms_norm",
    "select_backend",
    "write_kv_cache",
]
