"""Write this step's keys and values into the paged KV cache, quantizing to int8 when the cache is int8.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset.
INT8: symmetric per (token, kv head): scale = max|x| / 127 (>= 1e-8), q = round(x / scale) in [-127, 127]
(round half to even, as torch.round); the float32 scale is then stored in the scale cache's dtype.
"""

from __future__ import annotations

import torch

from kernels import cpu_int8_linear
from kernels._checks import (
    PagedCacheLayout,
    check_float_tensor,
    check_index_tensor,
    check_paged_cache,
    check_same_device,
)
from kernels._dispatch import select_backend
from kernels._triton import jit, next_power_of_2, require_triton_device, tl
from kernels.quantize import quantize_per_token_torch


@jit
def _write_cache_kernel(
    src_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim]
    scale_ptr,  # [num_blocks * block_size, num_kv_heads] float (QUANTIZE only)
    slot_ptr,  # [num_tokens] int64
    stride_token,
    stride_head,
    num_kv_heads,
    head_dim,
    QUANTIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < num_kv_heads
    mask = head_mask[:, None] & (dims[None, :] < head_dim)
    x = tl.load(
        src_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :], mask=mask, other=0.0
    )
    cache_offsets = (slot * num_kv_heads + heads[:, None]) * head_dim + dims[None, :]
    if QUANTIZE:
        x = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 127.0, 1e-8)  # [BLOCK_H]
        scaled = x / scale[:, None]
        # Adding and removing 1.5 * 2**23 rounds a float32 of magnitude < 2**22 half-to-even, like torch.round
        # (libdevice.rint is not available under the interpreter).
        rounded = (scaled + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
        tl.store(cache_ptr + cache_offsets, q, mask=mask)
        tl.store(
            scale_ptr + slot * num_kv_heads + heads, scale.to(scale_ptr.dtype.element_ty), mask=head_mask
        )
    else:
        tl.store(cache_ptr + cache_offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


def _check_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> PagedCacheLayout:
    layout = check_paged_cache(key_cache, value_cache, k_scale_cache, v_scale_cache)
    check_float_tensor("key", key, 3)
    check_float_tensor("value", value, 3)
    expected = (key.shape[0], layout.num_kv_heads, layout.head_dim)
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name} must be [num_tokens, num_kv_heads, head_dim] = {expected}, got {tuple(tensor.shape)}"
            )
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_index_tensor("slot_mapping", slot_mapping, torch.int64, (key.shape[0],))
    check_same_device(key=key, value=value, key_cache=key_cache, slot_mapping=slot_mapping)
    return layout


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    layout = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)
    require_triton_device(key, key_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    block_h = next_power_of_2(layout.num_kv_heads)
    block_d = next_power_of_2(layout.head_dim)
    for src, cache, scale_cache in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        _write_cache_kernel[(num_tokens,)](
            src, cache, scale_cache if layout.quantized else cache, slot_mapping,
            src.stride(0), src.stride(1), layout.num_kv_heads, layout.head_dim,
            QUANTIZE=layout.quantized, BLOCK_H=block_h, BLOCK_D=block_d,
        )  # fmt: skip


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    layout = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)
    num_slots = layout.num_blocks * layout.block_size
    for src, cache, scale_cache in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        slots = cache.view(num_slots, layout.num_kv_heads, layout.head_dim)
        if layout.quantized:
            q, scale = quantize_per_token_torch(src.reshape(-1, layout.head_dim))
            slots.index_copy_(0, slot_mapping, q.view(src.shape))
            scales = scale.view(src.shape[:2]).to(scale_cache.dtype)
            scale_cache.view(num_slots, layout.num_kv_heads).index_copy_(0, slot_mapping, scales)
        else:
            slots.index_copy_(0, slot_mapping, src.to(cache.dtype))


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    """The compiled CPU path of an INT8 cache (csrc/int8_linear_cpu.cpp write_kv_int8): quantize and scatter
    in one pass per tensor, the same codes and scales as write_kv_cache_torch."""
    layout = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)
    if not layout.quantized:
        raise ValueError("the compiled KV-cache writer takes INT8 caches only")
    num_slots = layout.num_blocks * layout.block_size
    slots = slot_mapping.contiguous()
    extension = cpu_int8_linear.load_extension()
    for src, cache, scale_cache in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        extension.write_kv_int8(
            src, slots, cache.view(num_slots, layout.num_kv_heads, layout.head_dim),
            scale_cache.view(num_slots, layout.num_kv_heads),
        )  # fmt: skip


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots `slot_mapping`, in place.

    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim], the key's float dtype or int8;
    k_scale_cache/v_scale_cache: [num_blocks, block_size, num_kv_heads] float32, required iff int8.
    """
    _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)
    backend = select_backend(
        key, compiled_supports=lambda: key_cache.dtype == torch.int8 and cpu_int8_linear.available()
    )
    writers = {"triton": write_kv_cache_triton, "compiled": write_kv_cache_cpu, "torch": write_kv_cache_torch}
    write = writers[backend]
    write(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)
