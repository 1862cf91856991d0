"""The row-block size at which this machine's float GEMM rounds a row alike wherever it sits in the block.

FloatLinear's exact mode (float32 without quantization) runs products in fixed blocks of B rows, so that a
row's result does not depend on how many rows share the step. That needs the GEMM library to round row i of
a B-row product the same for every position i and whatever the other rows hold. MKL's AVX-512 sgemm does at
B = 16 on SmolLM2's shapes (AMD EPYC, 2 threads); its AVX2 kernel on an Intel Xeon (2 threads) does not: at
K = 128, N = 64 rows 6, 7, 14 and 15 of 16 came out differently (each thread's 8 rows run as 6 + 2). So the
size is checked at load on the model's own projection shapes with random operands, largest candidate first;
one row at a time always holds.

Prefill runs thousands of rows through each product, and B-row products run those at about half the rate
of larger ones (SmolLM2's layer shapes, AMD EPYC, 2 threads: 92 GFLOP/s at 16 rows, 146 at 256, 188 at
2048). So wider blocks are checked too: a size is used where its product rounds every row exactly as the
row's B-row block does, which keeps each row's result independent of the batch (it is its block's result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.config import ModelConfig
from worker.engine.plan.shapes import expert_products, layer_products
from worker.engine.plan.shapes import lm_head as head_product

CANDIDATE_ROWS = (16, 12, 8, 6, 4, 2)  # tried in this order; 1 (row by row) is the fallback
WIDE_CANDIDATE_ROWS = (1024, 256)  # wide blocks for long inputs, each used where it rounds like the blocks


def projection_shapes(model: ModelConfig, *, lm_head: bool = True) -> list[tuple[int, int]]:
    """(in_features, out_features) of every float product a layer (and the LM head) runs: a dense layer's
    four, the LM head's, and in an MoE model the router's and an expert's two (shapes.py)."""
    products = layer_products(model) + ([head_product(model)] if lm_head else []) + expert_products(model)
    return [(p.in_features, p.out_features) for p in products]


def rounds_alike_at_every_position(
    in_features: int, out_features: int, rows: int, dtype: torch.dtype
) -> bool:
    """Whether row 0 of a `rows`-row product equals the same row placed at every other position among
    different rows."""
    generator = torch.Generator().manual_seed(rows * 7919 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    want = F.linear(x, weight)[0]
    for position in range(1, rows):
        others = torch.randn(rows, in_features, generator=generator).to(dtype)
        others[position] = x[0]
        if not torch.equal(F.linear(others, weight)[position], want):
            return False
    return True


def invariant_block_rows(model: ModelConfig, dtype: torch.dtype) -> int:
    """The largest candidate block at which every projection shape of `model` rounds alike (else 1), at the
    current torch thread count."""
    shapes = projection_shapes(model)
    for rows in CANDIDATE_ROWS:
        if all(rounds_alike_at_every_position(k, n, rows, dtype) for k, n in shapes):
            return rows
    return 1


def rounds_like_its_blocks(in_features: int, out_features: int, rows: int, block: int, dtype: torch.dtype) -> bool:
    """Whether a `rows`-row product equals, bit for bit, the same rows multiplied `block` rows at a time."""
    generator = torch.Generator().manual_seed(rows * 31 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    return torch.equal(F.linear(x, weight), torch.cat([F.linear(part, weight) for part in x.split(block)]))


def wide_block_rows(model: ModelConfig, dtype: torch.dtype, block: int) -> tuple[int, ...]:
    """The wide candidates (descending) at which every layer projection of `model` rounds like its `block`-row
    blocks. The LM head is left out: prefill asks it for one row per prompt, so its rows are few."""
    if block <= 1:  # no blocks (0), or row by row: nothing to widen
        return ()
    shapes = projection_shapes(model, lm_head=False)
    return tuple(
        rows for rows in WIDE_CANDIDATE_ROWS
        if rows % block == 0 and all(rounds_like_its_blocks(k, n, rows, block, dtype) for k, n in shapes)
    )  # fmt: skip


def invariance_rows(model: ModelConfig, dtype: torch.dtype, exact: bool, configured: int | str) -> tuple[int, tuple[int, ...]]:
    """(block rows, wide block rows) of the float projections: `configured` unless "auto"; "auto" checks the
    largest invariant block in the exact mode (unquantized float32 on CPU) and runs no blocks (0) otherwise."""
    if configured != "auto":
        block = int(configured)
    else:
        block = invariant_block_rows(model, dtype) if exact else 0
    return block, wide_block_rows(model, dtype, block)
