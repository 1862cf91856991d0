"""Linear layers: float, or INT8 weights with per-token INT8 activations (W8A8) on one of three GEMMs.

INT8 backends: "int_mm" runs torch._int_mm (s8 x s8; fast with AVX-512 VNNI, and the CUDA path), "onednn"
runs oneDNN's u8 x s8 qlinear (fast on AVX2, where torch._int_mm is 50x slower than float32), "amx" our own
GEMM on AMX tiles with the epilogue fused (kernels/cpu_int8_gemm_amx.py; CPUs with AMX-INT8); plan/schemes.py
measures which one this machine runs faster. On CPU, batches of at most `small_batch_rows` rows take our
own weight-streaming product instead (kernels/cpu_int8_small_batch.py; the threshold is measured by
plan/small_batch.py): same weight codes, exact integer products, so the outputs do not change with it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels import cpu_int8_gemm_amx, cpu_int8_linear, cpu_int8_small_batch, rms_norm
from kernels.cpu_int8_gemm_amx import QuantizedRows
from kernels.int8_linear import GATE_ACTIVATIONS, gate_activation, int8_linear, int8_linear_silu_mul
from kernels.norm import rms_norm_quantize_cpu
from kernels.quantize import quantize_weight_per_channel

Int8Backend = Literal["int_mm", "onednn", "amx", "triton"]


def gated(linear: Linear, x: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's fused gate/up projection: [tokens, in] -> act(gate) * up [tokens, out / 2], on the linear's
    fused path where it has one (gate and up never stored on CPU INT8)."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"unknown MLP activation {activation!r}")
    return linear.gated_mul(x, activation)


class _NormedInput:
    """`normed`: the layer's input made from the residual stream by its RMSNorm. Plain here; the AMX layer
    fuses the norm with its activation quantization."""

    def normed(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | QuantizedRows:
        return rms_norm(hidden, weight, eps)


class FloatLinear(_NormedInput):
    """A float projection. With invariant_rows = B > 0 the product runs in blocks of exactly B rows (the last
    one padded), so a row's result does not depend on how many rows share the step: CPU GEMM libraries
    round a row differently at different row counts (MKL's sgemm: row 0 of X[:M] @ W.T differs bitwise
    between M = 2 and M = 4), which lets any change of batch composition (a draft's rows, other requests)
    flip a greedy near-tie. A fixed-size product rounds a row the same wherever it sits in the block and
    whatever the other rows hold, at a block size the engine checks at load on the model's shapes
    (plan/invariance.py: 16 with MKL's AVX-512 sgemm; smaller where a kernel splits a block unevenly). Long inputs
    (prefill) run as far as they go in wide blocks (wide_rows, descending), sizes at which the check found a
    product rounds every row as its B-row blocks do: the same results at up to 2x the GEMM rate."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        out_dtype: torch.dtype | None,
        invariant_rows: int = 0,
        wide_rows: tuple[int, ...] = (),
    ) -> None:
        self.weight = weight.to(dtype).contiguous()  # [out_features, in_features]
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype  # None: dtype
        self.invariant_rows = invariant_rows
        self.wide_rows = wide_rows  # descending multiples of invariant_rows

    def _product(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        block = self.invariant_rows
        if not block or x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        parts, start = [], 0
        for wide in self.wide_rows:
            while x.shape[0] - start >= wide:
                parts.append(x[start : start + wide])
                start += wide
        if start < x.shape[0]:
            parts += x[start:].split(block)
            short = block - parts[-1].shape[0]
            if short:  # only the last block is padded (with zero rows, whose results are dropped)
                parts[-1] = torch.cat([parts[-1], x.new_zeros(short, x.shape[1])])
        return torch.cat([F.linear(part, self.weight, self.bias) for part in parts])[: x.shape[0]]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, in] -> [tokens, out], plus residual [tokens, out] when given."""
        y = self._product(x)
        if self.out_dtype is not None:
            y = y.to(self.out_dtype)
        return y if residual is None else residual + y  # transformers' order, for exact float32 parity

    def gated_mul(self, x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """A gated MLP's fused gate/up projection: [tokens, in] -> act(gate) * up [tokens, out / 2]."""
        gate, up = self._product(x).chunk(2, dim=-1)
        return gate_activation(gate, activation) * up


class _SmallBatch:
    """The small-batch path of an INT8 linear on CPU: rows up to `rows` go through our own product on the
    same weight codes [out, in] as the layer's GEMM (0: never), prepared in the build's layout."""

    def __init__(self, codes: torch.Tensor, rows: int, keep_codes: bool = False) -> None:
        usable = codes.device.type == "cpu" and cpu_int8_small_batch.available()
        self.rows = rows if usable else 0
        kept = bool(self.rows) or (keep_codes and usable)  # keep_codes: for `argmax` at any row count
        self.weights = cpu_int8_small_batch.prepare(codes) if kept else None

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.rows


class _Int8Layer(_NormedInput):
    """What the INT8 backends share: the small-batch path for few rows, the backend's GEMM (`_product`,
    `_product_silu_mul`) for more, over the same codes and scales, so a row's outputs do not depend on which
    ran. The gate's activation and the multiply are fused unless the layer has a bias (or the backend cannot
    fuse that activation: then neither path fuses it, so both round alike)."""

    w_scale: torch.Tensor  # [out] float32
    bias: torch.Tensor | None
    out_dtype: torch.dtype | None  # None: the input's dtype
    small: _SmallBatch

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _product_silu_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        raise NotImplementedError

    def _fuses(self, activation: str) -> bool:
        return self.bias is None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, in] -> [tokens, out], plus residual [tokens, out] when given (fused on CPU)."""
        if self.small.takes(x):
            return cpu_int8_small_batch.int8_linear_small_batch(
                x, self.small.weights, self.w_scale, self.bias, self.out_dtype, residual
            )
        return self._product(x, residual)

    @property
    def picks_greedy(self) -> bool:
        """Whether `argmax` runs here: codes kept on CPU, no bias."""
        return self.small.weights is not None and self.bias is None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens] int64
        """Each row's first maximal float32 output, without making the [tokens, out] outputs: the same index as
        `self(x).max(-1)` (the same codes, scales and epilogue), for a greedy step's LM head."""
        if not self.picks_greedy:
            raise ValueError("argmax needs the layer's codes on CPU (keep_codes) and no bias")
        return cpu_int8_small_batch.int8_argmax_small_batch(x, self.small.weights, self.w_scale)[0]

    def gated_mul(self, x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """[tokens, in] -> act(gate) * up [tokens, out / 2]; gate and up are never stored on CPU when fused."""
        if not self._fuses(activation):
            gate, up = self(x).chunk(2, dim=-1)
            return gate_activation(gate, activation) * up
        if self.small.takes(x):
            return cpu_int8_small_batch.int8_linear_silu_mul_small_batch(
                x, self.small.weights, self.w_scale, self.out_dtype, activation
            )
        return self._product_silu_mul(x, activation)


class Int8Linear(_Int8Layer):
    """Per-output-channel symmetric INT8 weights, quantized once at load time."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        out_dtype: torch.dtype | None,
        small_batch_rows: int = 0,
        keep_codes: bool = False,
    ) -> None:
        w_q, self.w_scale = quantize_weight_per_channel(weight.float())  # [out, in] int8, [out] fp32
        self.w_q_t = w_q.t()  # [in, out] view of the contiguous [out, in] tensor
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype
        self.small = _SmallBatch(w_q, small_batch_rows, keep_codes)  # rows layout: the same codes

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, self.w_q_t, self.w_scale, self.bias, self.out_dtype, residual=residual)

    def _product_silu_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        return int8_linear_silu_mul(x, self.w_q_t, self.w_scale, self.out_dtype, activation)


class OnednnInt8Linear(_Int8Layer):
    """W8A8 through oneDNN's u8 x s8 GEMM (weights prepacked once; per-token scales in our epilogue).

    With a small-batch path its codes are kept beside oneDNN's packed copy (the packing is opaque), in the
    small-batch layout, which costs one more byte per weight: the plan enables it only where it measured faster."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        out_dtype: torch.dtype | None,
        small_batch_rows: int = 0,
        keep_codes: bool = False,
    ) -> None:
        w_q, self.w_scale = quantize_weight_per_channel(weight.float(), cpu_int8_linear.weight_qmax())
        self.weight = cpu_int8_linear.prepack_codes(w_q, self.w_scale)
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype
        self.small = _SmallBatch(w_q, small_batch_rows, keep_codes)

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return cpu_int8_linear.int8_linear_onednn(x, self.weight, self.bias, self.out_dtype, residual)

    def _product_silu_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        return cpu_int8_linear.int8_linear_silu_mul_onednn(x, self.weight, self.out_dtype, activation)


class AmxInt8Linear(_Int8Layer):
    """W8A8 through our AMX tile GEMM: the codes packed once for the tiles (the gate/up weight in gated
    blocks, so SiLU-and-multiply runs on each block of products), the epilogue applied in L1."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        out_dtype: torch.dtype | None,
        small_batch_rows: int = 0,
        gated: bool = False,
        keep_codes: bool = False,
    ) -> None:
        w_q, self.w_scale = quantize_weight_per_channel(weight.float())  # [out, in] int8, [out] fp32
        # gated_mul needs the gated packing (2 * I a multiple of 32); such a weight is only ever used that way
        self.gated = gated and bias is None and w_q.shape[0] % 32 == 0
        self.weight = cpu_int8_gemm_amx.pack_gated(w_q) if self.gated else cpu_int8_gemm_amx.pack(w_q)
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype
        self.small = _SmallBatch(w_q, small_batch_rows, keep_codes)

    def _fuses(self, activation: str) -> bool:
        return self.gated and activation == "silu"  # the tile GEMM's epilogue makes SiLU only

    def normed(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | QuantizedRows:
        """Rows the tile GEMM takes get their codes straight from the norm (the same codes, one pass fewer over
        the rows: norm.rms_norm_quantize_cpu); the small-batch path takes the float rows, as does float32."""
        if hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or self.small.takes(hidden):
            return rms_norm(hidden, weight, eps)
        codes, scales = rms_norm_quantize_cpu(hidden, weight, eps)
        return QuantizedRows(codes, scales, hidden.dtype)

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.gated:
            raise ValueError("a gated AMX weight computes silu(gate) * up only (gated_mul)")
        return cpu_int8_gemm_amx.int8_linear_amx(x, self.weight, self.w_scale, self.bias, self.out_dtype, residual)

    def _product_silu_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        return cpu_int8_gemm_amx.int8_linear_silu_mul_amx(x, self.weight, self.w_scale, self.out_dtype)


Linear = FloatLinear | Int8Linear | OnednnInt8Linear | AmxInt8Linear


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    quantization: str | None,
    out_dtype: torch.dtype | None = None,
    int8_backend: Int8Backend | None = None,
    small_batch_rows: int = 0,
    invariant_rows: int = 0,
    wide_rows: tuple[int, ...] = (),
    gated: bool = False,
    keep_codes: bool = False,
) -> Linear:
    """int8_backend: "onednn" or "amx" on CPU when plan/schemes.py chose it; anything else runs int8_linear's
    dispatch. gated: a gate-then-up weight only ever used through gated_mul with SiLU (the AMX backend packs it so).
    small_batch_rows: INT8 products of at most this many rows run the small-batch kernel (CPU).
    invariant_rows: float products in blocks of this many rows (FloatLinear), 0 for one product; wide_rows:
    larger blocks that round like them. keep_codes: an INT8 layer on CPU keeps its plain codes for `argmax`
    (one more byte per weight beside oneDNN's or AMX's packed copy when the small-batch path does not)."""
    if quantization == "int8":
        if int8_backend == "onednn" and weight.device.type == "cpu":
            return OnednnInt8Linear(weight, bias, dtype, out_dtype, small_batch_rows, keep_codes)
        if int8_backend == "amx" and weight.device.type == "cpu" and cpu_int8_gemm_amx.supports(weight):
            return AmxInt8Linear(weight, bias, dtype, out_dtype, small_batch_rows, gated, keep_codes)
        return Int8Linear(weight, bias, dtype, out_dtype, small_batch_rows, keep_codes)
    return FloatLinear(weight, bias, dtype, out_dtype, invariant_rows, wide_rows)
