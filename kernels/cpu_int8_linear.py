"""W8A8 linear on CPU: an int8 GEMM with the passes around it compiled (C++ with OpenMP, built on first use).

Two GEMMs. torch._int_mm (s8 x s8) is fast with AVX-512 VNNI but runs at 3-6 GOP/s on AVX2, 20-40x
slower than float32. oneDNN's u8 x s8 qlinear (the oneDNN backend below) runs 1.5-2x the float32 rate on
the 2-core AVX2 VM from 64 rows up (float32 activations; bfloat16 ones 8-15x, as float bfloat16 GEMMs
run at about 20 GOP/s there), though slower than float32 for 1 to 16 rows. Activations go in as uint8
q + 128 with a constant zero point of 128 and per-tensor scale 1, so the product comes out as the exact
integer sum in float32 (weight codes within weight_qmax()), and our per-token and per-channel scales
stay in our epilogue.

Around either GEMM what costs is quantizing activations (abs, amax, divide, round, clamp, cast) and
turning products back into floats (cast, two scale multiplies, bias, cast, then the residual add or
SiLU-and-multiply of the caller). csrc/int8_linear_cpu.cpp does each side in one pass. Arguments of the
torch._int_mm functions are checked by the callers in kernels/int8_linear.py; the oneDNN functions check
their own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels._checks import check_float_tensor, resolve_out_dtype
from kernels._cpu_build import build_extension
from kernels.int_mm import int_mm
from kernels.platform import cpu_info
from kernels.quantize import quantize_weight_per_channel

log = logging.getLogger(__name__)


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (logged once)."""
    return build_extension("freight_int8_linear_cpu", "int8_linear_cpu.cpp", fast_math=False)


def available() -> bool:
    return load_extension() is not None


def _extension() -> ModuleType:
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU int8-linear extension is not available")
    return extension


def quantize_per_token_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] int8, x_scale [M] float32); same results as quantize_per_token_torch."""
    x = x.contiguous()
    x_q = torch.empty(x.shape, dtype=torch.int8)
    x_scale = torch.empty((x.shape[0],), dtype=torch.float32)
    _extension().quantize_rows(x, x_q, x_scale)
    return x_q, x_scale


def quantize_per_token_u8_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q + 128 [M, K] uint8, x_scale [M] float32): the codes of quantize_per_token_cpu
    shifted to oneDNN's unsigned activations (zero point 128)."""
    x = x.contiguous()
    x_u8 = torch.empty(x.shape, dtype=torch.uint8)
    x_scale = torch.empty((x.shape[0],), dtype=torch.float32)
    _extension().quantize_rows(x, x_u8, x_scale)
    return x_u8, x_scale


# oneDNN's int8 GEMM here slows down sharply past about 2048 output columns (SmolLM2's 3072-wide gate/up
# product runs at half the rate of its 1536-wide halves), so wide products run in column chunks.
MAX_GEMM_COLUMNS = 2048


def column_chunks(n: int) -> list[slice]:
    """Equal column slices of at most MAX_GEMM_COLUMNS."""
    count = -(-n // MAX_GEMM_COLUMNS)
    width = -(-n // count)
    return [slice(start, min(start + width, n)) for start in range(0, n, width)]


# Rows per product when its int32 (torch._int_mm) or float32 (oneDNN) output is consumed right away: the
# product stays in cache (a [512, 3072] float32 one is 6 MiB, in L3) and the temporary stays small. On the
# 2-core AVX2 VM oneDNN ran 256-row chunks up to 15% slower than 512 and whole 2048-row products no faster.
ROW_CHUNK = 512


def row_chunks(m: int) -> list[slice]:
    return [slice(start, min(start + ROW_CHUNK, m)) for start in range(0, m, ROW_CHUNK)]


def int8_linear_cpu(
    x: torch.Tensor,  # [M, K] float
    w_q_t: torch.Tensor,  # [K, N] int8
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    residual: torch.Tensor | None = None,  # [M, N]: added to the output (a transformer's skip connection)
) -> torch.Tensor:  # [M, N] in out_dtype
    x_q, x_scale = quantize_per_token_cpu(x)
    out = torch.empty((x.shape[0], w_q_t.shape[1]), dtype=out_dtype)
    bias = None if bias is None else bias.to(out_dtype).contiguous()
    residual = None if residual is None else residual.to(out_dtype)
    for cols in column_chunks(w_q_t.shape[1]):
        acc = int_mm(x_q, w_q_t[:, cols])  # [M, n] int32
        _extension().dequantize_rows(
            acc,
            x_scale,
            w_scale[cols].contiguous(),
            None if bias is None else bias[cols].contiguous(),
            None if residual is None else residual[:, cols],
            out[:, cols],
        )
    return out


def int8_linear_silu_mul_cpu(
    x: torch.Tensor,  # [M, K] float
    w_q_t: torch.Tensor,  # [K, 2 * I] int8: gate columns, then up columns
    w_scale: torch.Tensor,  # [2 * I] float32
    out_dtype: torch.dtype,
    activation: str = "silu",  # or "gelu_tanh"
) -> torch.Tensor:  # [M, I] = act(gate) * up, in out_dtype
    x_q, x_scale = quantize_per_token_cpu(x)
    half = w_q_t.shape[1] // 2
    out = torch.empty((x.shape[0], half), dtype=out_dtype)
    for cols in column_chunks(half):
        up_cols = slice(half + cols.start, half + cols.stop)
        w_gate, w_up = w_scale[cols].contiguous(), w_scale[up_cols].contiguous()
        for rows in row_chunks(x.shape[0]):  # the int32 products stay in cache for the epilogue
            gate = int_mm(x_q[rows], w_q_t[:, cols])  # [m, n] int32
            up = int_mm(x_q[rows], w_q_t[:, up_cols])
            _extension().dequantize_silu_mul(gate, up, x_scale[rows], w_gate, w_up, out[rows, cols], activation)
    return out


# ---------------------------------------------------------------------------------------------------
# oneDNN backend: torch.ops.onednn.qlinear_pointwise on a weight prepacked once.

ZERO_POINT = 128  # of the uint8 activations: x_u8 - 128 = x_q exactly


@dataclass(frozen=True)
class OnednnWeight:
    """A linear layer's weight quantized per output channel and prepacked for oneDNN's u8 x s8 qlinear."""

    packed: torch.Tensor  # oneDNN's opaque layout of w_q [N, K] int8, |codes| <= weight_qmax()
    w_scale: torch.Tensor  # [N] float32: w ~ w_q * w_scale[:, None], applied in our epilogue
    N: int
    K: int
    # oneDNN's own per-channel weight scales and zero points: ones and zeros (ours are in the epilogue)
    unit_scale: torch.Tensor  # [N] float32
    zero_point: torch.Tensor  # [N] int32


def _qlinear(x_u8: torch.Tensor, w: OnednnWeight) -> torch.Tensor:
    """x_u8 [M, K] uint8 contiguous -> (x_u8 - 128) @ w_q.T as [M, N] float32 (exact below 2**24)."""
    return torch.ops.onednn.qlinear_pointwise(
        x_u8, 1.0, ZERO_POINT, w.packed, w.unit_scale, w.zero_point, None, 1.0, 0, torch.float32, "none", [], ""
    )  # fmt: skip


def _prepack(w_q: torch.Tensor, w_scale: torch.Tensor) -> OnednnWeight:
    N, K = w_q.shape
    # The row count is only a hint: products of any M on this packing are exact (the tests run several).
    packed = torch.ops.onednn.qlinear_prepack(w_q, [ROW_CHUNK, K])
    return OnednnWeight(packed, w_scale, N, K, torch.ones(N), torch.zeros(N, dtype=torch.int32))


def _worst_case_exact(qmax: int) -> bool:
    """Whether oneDNN computes the largest products exactly with weight codes up to qmax: every activation
    at +127 against rows of +qmax and -qmax, at M = 1 and M = 32 (oneDNN picks kernels by shape)."""
    K, N = 64, 16
    w_q = torch.full((N, K), qmax, dtype=torch.int8)
    w_q[1::2] = -qmax
    w = _prepack(w_q, torch.ones(N))
    for M in (1, 32):
        x_u8 = torch.full((M, K), 127 + ZERO_POINT, dtype=torch.uint8)
        want = torch.full((M, K), 127.0) @ w_q.float().t()  # |sums| < 2**24: exact in float32
        if not torch.equal(_qlinear(x_u8, w), want):
            return False
    return True


@functools.cache
def weight_qmax() -> int:
    """The largest weight code oneDNN's u8 x s8 GEMM multiplies exactly here: 127 with VNNI, else 63.

    Without VNNI oneDNN multiplies with vpmaddubsw, which adds each pair of u8 x s8 products in int16 and
    saturates: 2 * 255 * 127 overflows it, 2 * 255 * 63 = 32130 does not. A VNNI CPU capped at a lower ISA
    (ONEDNN_MAX_CPU_ISA=AVX2, as FREIGHT_CPU_ISA=avx2 sets) takes that path too, so the flag is confirmed
    by running the worst case.
    """
    return 127 if cpu_info().has_vnni and _worst_case_exact(127) else 63


@functools.cache
def onednn_available() -> bool:
    """Whether the oneDNN backend runs here: the compiled passes built, and the qlinear ops exist and
    multiply the worst case exactly at weight_qmax()."""
    if not available():
        return False
    try:
        return _worst_case_exact(weight_qmax())
    except (AttributeError, RuntimeError) as exc:  # a torch built without oneDNN, or without these ops
        log.warning("oneDNN int8 linear unavailable (%s)", exc)
        return False


def prepack_onednn(weight: torch.Tensor) -> OnednnWeight:
    """weight [N, K] float -> its per-channel int8 codes (qmax = weight_qmax()) prepacked for oneDNN."""
    check_float_tensor("weight", weight, 2)
    return _prepack(*quantize_weight_per_channel(weight, weight_qmax()))


def prepack_codes(w_q: torch.Tensor, w_scale: torch.Tensor) -> OnednnWeight:
    """Per-channel codes w_q [N, K] int8 (|codes| <= weight_qmax()) and w_scale [N] -> prepacked for oneDNN."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2 or tuple(w_scale.shape) != (w_q.shape[0],):
        raise ValueError(f"w_q must be [N, K] int8 with w_scale [N], got {tuple(w_q.shape)} {w_q.dtype}, "
                         f"{tuple(w_scale.shape)}")  # fmt: skip
    if w_q.numel() and int(w_q.abs().max()) > weight_qmax():
        raise ValueError(f"weight codes exceed {weight_qmax()}, the largest oneDNN multiplies exactly here")
    return _prepack(w_q.contiguous(), w_scale)


def padded_rows(m: int) -> int:
    """m rounded up to a row count oneDNN has likely seen: m itself below 16, then 8 steps per power of two.

    oneDNN builds (JIT-compiles) a primitive for every new row count, about 1 ms on the 2-core AVX2 VM
    (K, N = 576, 960: as long as the product of 150 rows itself), and caches 1024 of them. With at most 56
    row counts per weight shape up to ROW_CHUNK, a model's handful of shapes stays inside that cache, for
    at most 1/8 extra rows; a sweep over 128 row counts measured no slower in steady state padded.
    """
    if m < 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def _quantize_padded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_u8 [P, K] uint8, x_scale [M] float32): rows past M, up to the padded size P of
    the last row chunk, are left uninitialized (their products are computed and never read)."""
    M, K = x.shape
    full, last = divmod(M, ROW_CHUNK)
    x_u8 = torch.empty((full * ROW_CHUNK + padded_rows(last), K), dtype=torch.uint8)
    x_scale = torch.empty((M,), dtype=torch.float32)
    _extension().quantize_rows(x.contiguous(), x_u8[:M], x_scale)
    return x_u8, x_scale


def _products(x_u8: torch.Tensor, M: int, w: OnednnWeight) -> Iterator[tuple[slice, torch.Tensor]]:
    """Per row chunk of the M real rows of _quantize_padded's x_u8: (rows, acc [len(rows), N] float32)."""
    for start in range(0, M, ROW_CHUNK):
        stop = min(start + ROW_CHUNK, M)
        yield slice(start, stop), _qlinear(x_u8[start : start + ROW_CHUNK], w)[: stop - start]


def _check_onednn_args(x: torch.Tensor, w: OnednnWeight, out_dtype: torch.dtype | None) -> torch.dtype:
    check_float_tensor("x", x, 2)
    if x.device.type != "cpu":
        raise ValueError(f"the oneDNN int8 linear runs on CPU tensors, got {x.device}")
    if x.shape[1] != w.K:
        raise ValueError(f"x has K = {x.shape[1]} columns but the weight is [N, K] = [{w.N}, {w.K}]")
    return resolve_out_dtype(x, out_dtype)


def int8_linear_onednn(
    x: torch.Tensor,  # [M, K] float
    w: OnednnWeight,
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x.dtype
    residual: torch.Tensor | None = None,  # [M, N]: added to the output (a transformer's skip connection)
) -> torch.Tensor:  # [M, N] = x @ w.T (+ bias) (+ residual), in out_dtype
    out_dtype = _check_onednn_args(x, w, out_dtype)
    M = x.shape[0]
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"bias must have shape [{w.N}], got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (M, w.N):
        raise ValueError(f"residual must have shape [{M}, {w.N}], got {tuple(residual.shape)}")
    x_u8, x_scale = _quantize_padded(x)
    out = torch.empty((M, w.N), dtype=out_dtype)
    bias = None if bias is None else bias.to(out_dtype).contiguous()
    residual = None if residual is None else residual.to(out_dtype)
    for rows, acc in _products(x_u8, M, w):  # acc [m, N] float32
        _extension().dequantize_rows(
            acc, x_scale[rows], w.w_scale, bias, None if residual is None else residual[rows], out[rows]
        )
    return out


def int8_linear_silu_mul_onednn(
    x: torch.Tensor,  # [M, K] float
    w_gate_up: OnednnWeight,  # N = 2 * I: gate rows, then up rows
    out_dtype: torch.dtype | None = None,  # default x.dtype
    activation: str = "silu",  # or "gelu_tanh"
) -> torch.Tensor:  # [M, I] = act(x @ w_gate.T) * (x @ w_up.T), in out_dtype
    out_dtype = _check_onednn_args(x, w_gate_up, out_dtype)
    if w_gate_up.N % 2:
        raise ValueError(f"the gate/up weight must have 2 * I rows (gate, then up), got N = {w_gate_up.N}")
    half = w_gate_up.N // 2
    x_u8, x_scale = _quantize_padded(x)
    out = torch.empty((x.shape[0], half), dtype=out_dtype)
    w_gate, w_up = w_gate_up.w_scale[:half], w_gate_up.w_scale[half:]
    for rows, acc in _products(x_u8, x.shape[0], w_gate_up):  # acc [m, 2 * I] float32
        _extension().dequantize_silu_mul(
            acc[:, :half], acc[:, half:], x_scale[rows], w_gate, w_up, out[rows], activation
        )
    return out
