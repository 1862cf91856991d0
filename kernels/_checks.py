"""Argument checks shared by the ops: each raises ValueError naming the argument and what was expected."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT8_SCALE_EPS = 1e-8  # smallest quantization scale: an all-zero row quantizes to zeros, not NaN


@dataclass(frozen=True)
class PagedCacheLayout:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    quantized: bool  # int8 values with a float scale per (slot, kv head)


def resolve_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """out_dtype, defaulting to x's dtype; refused unless a float dtype the kernels write."""
    out_dtype = out_dtype or x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return out_dtype


def check_float_tensor(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")


def check_index_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_paged_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> PagedCacheLayout:
    """Caches are [num_blocks, block_size, num_kv_heads, head_dim], float, or int8 with float scale caches
    [num_blocks, block_size, num_kv_heads] (float32 as specified; float16/bfloat16 also work, to save memory:
    scales are computed in float32 and rounded when stored)."""
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match "
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if key_cache.dtype not in (*FLOAT_DTYPES, torch.int8):
        raise ValueError(f"caches must be float32, bfloat16, float16 or int8, got {key_cache.dtype}")
    # The kernels address slots as flat offsets, and the torch paths flatten blocks with views.
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    quantized = key_cache.dtype == torch.int8
    if quantized:
        for name, scale in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if scale is None:
                raise ValueError(f"{name} is required with an int8 cache")
            if scale.dtype not in FLOAT_DTYPES or tuple(scale.shape) != (
                num_blocks,
                block_size,
                num_kv_heads,
            ):
                raise ValueError(
                    f"{name} must be float [{num_blocks}, {block_size}, {num_kv_heads}], "
                    f"got {scale.dtype} {tuple(scale.shape)}"
                )
            if not scale.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
    elif k_scale_cache is not None or v_scale_cache is not None:
        raise ValueError(
            f"k_scale_cache/v_scale_cache are only for int8 caches, the cache is {key_cache.dtype}"
        )
    check_same_device(
        key_cache=key_cache, value_cache=value_cache, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache
    )
    return PagedCacheLayout(num_blocks, block_size, num_kv_heads, head_dim, quantized)


def check_attention_heads(query: torch.Tensor, layout: PagedCacheLayout) -> int:
    """query [..., num_heads, head_dim]; returns the GQA group size num_heads // num_kv_heads."""
    num_heads, head_dim = query.shape[-2:]
    if head_dim != layout.head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {layout.head_dim}")
    if num_heads % layout.num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {layout.num_kv_heads}")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last dimension")
    return num_heads // layout.num_kv_heads


def check_attention_options(window: int, soft_cap: float) -> tuple[int, float]:
    """The attention ops' sliding window (an int >= 0; 0: none) and logit soft cap (a finite float >= 0;
    0: none), returned as a Python int and float."""
    # bool is an int: window=True is more likely a mistake than a window of 1
    integral = not isinstance(window, bool) and hasattr(window, "__index__")
    if not integral or operator.index(window) < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, numbers.Real) or not math.isfinite(soft_cap):
        raise ValueError(f"soft_cap must be a finite float >= 0 (0: no soft cap), got {soft_cap!r}")
    if soft_cap < 0:
        raise ValueError(f"soft_cap must be a finite float >= 0 (0: no soft cap), got {soft_cap!r}")
    return operator.index(window), float(soft_cap)
