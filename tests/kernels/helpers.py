"""Shared test fixtures for the kernels: backends and randomly filled paged KV caches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels._triton import interpreter_enabled, triton_available


def _interpreter_ready() -> bool:
    """Triton decorates its own library (tl.zeros, tl.max, ...) when it is imported: the interpreter works
    only if TRITON_INTERPRET=1 was set before that. In the full suite the root conftest imports transformers,
    which imports torch._dynamo and with it triton, before tests/kernels/conftest.py runs; then the
    interpreter cases run in a fresh process instead (test_triton_subprocess.py)."""
    if not (triton_available() and interpreter_enabled()):
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


INTERPRETER_READY = _interpreter_ready()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER_READY,
    reason="needs triton imported under TRITON_INTERPRET=1 (see test_triton_subprocess.py)",
)
needs_cuda = pytest.mark.skipif(
    not (triton_available() and torch.cuda.is_available()) or interpreter_enabled(),
    reason="needs triton, a CUDA device and TRITON_INTERPRET unset or 0",
)


@dataclass(frozen=True)
class Backend:
    """torch: the CPU torch path; interpret: the Triton kernel on CPU tensors; cuda: the compiled kernel."""

    name: str
    device: str

    @property
    def triton(self) -> bool:
        return self.name != "torch"

    @property
    def small_tiles(self) -> bool:
        """Under the interpreter, 16-wide tiles keep numpy fast and make short contexts span several tiles."""
        return self.name == "interpret"


TORCH = pytest.param(Backend("torch", "cpu"), id="torch")
INTERPRET = pytest.param(Backend("interpret", "cpu"), id="interpret", marks=needs_interpreter)
CUDA = pytest.param(Backend("cuda", "cuda"), id="cuda", marks=[pytest.mark.cuda, needs_cuda])
BACKENDS = [TORCH, INTERPRET, CUDA]
TRITON_BACKENDS = [INTERPRET, CUDA]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Tolerance by the output dtype: float32 tight, 16-bit types one or two units in the last place."""
    tight = actual.dtype == torch.float32
    torch.testing.assert_close(
        actual.cpu().double(),
        expected.cpu().double(),
        atol=2e-5 if tight else 2e-2,
        rtol=1e-4 if tight else 2e-2,
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    k_scale_cache: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads]
    v_scale_cache: torch.Tensor | None
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, out-of-range garbage past each sequence

    def to(self, device: str) -> PagedKV:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PagedKV(*(move(t) for t in (self.key_cache, self.value_cache, self.k_scale_cache,
                                           self.v_scale_cache, self.block_tables)))  # fmt: skip


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    scale_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedKV:
    """Random caches whose sequences own shuffled, scattered blocks.

    Every slot outside the sequences' contexts holds NaN (float caches) or a NaN scale (int8 caches), and
    block-table entries past a sequence's blocks are out of range: a kernel that reads them fails the test.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if cache_dtype == torch.int8:
        key_cache = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        value_cache = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        k_scale = (torch.rand(shape[:3], generator=gen) * 0.05 + 0.005).to(scale_dtype)
        v_scale = (torch.rand(shape[:3], generator=gen) * 0.05 + 0.005).to(scale_dtype)
    else:
        key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
        value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
        k_scale = v_scale = None

    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.randint(num_blocks + 1000, 2**30, (len(seq_lens), max_blocks), generator=gen)
    in_context = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for seq, (length, count) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks, order = order[:count], order[count:]
        block_tables[seq, :count] = torch.tensor(blocks)
        for position in range(length):
            in_context[blocks[position // block_size], position % block_size] = True
    if cache_dtype == torch.int8:
        k_scale[~in_context] = float("nan")
        v_scale[~in_context] = float("nan")
    else:
        key_cache[~in_context] = float("nan")
        value_cache[~in_context] = float("nan")
    return PagedKV(key_cache, value_cache, k_scale, v_scale, block_tables.to(torch.int32))


# (query dtype, cache dtype) pairs the engine runs: float32 throughout, int8 caches, bfloat16 throughout.
DTYPE_PAIRS = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.float32, torch.int8, id="fp32-int8"),
    pytest.param(torch.bfloat16, torch.int8, id="bf16-int8"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
]
