"""One dispatch rule for every public op (kernels/_dispatch.py): which backend ran for CPU tensors with the
compiled kernel available, with it disabled (compiled=False, FREIGHT_CPU_KERNELS=0), and that bad arguments
are refused on every branch before any backend runs."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch

import kernels
from kernels import (
    cpu_decode_attention,
    cpu_int8_linear,
    cpu_prefill_attention,
    decode_attention,
    kv_cache,
    prefill_attention,
)
from kernels._dispatch import select_backend

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

int8_linear = importlib.import_module("kernels.int8_linear")  # the package's `int8_linear` is the op

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE = 4, 2, 64, 8, 16


def caches() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape), torch.randn(shape)


def decode_call(bad: bool = False, **options) -> None:
    key_cache, value_cache = caches()
    lens = torch.tensor([5, 3], dtype=torch.int64 if bad else torch.int32)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    kernels.paged_decode_attention(
        torch.randn(2, HEADS, HEAD_DIM), key_cache, value_cache, block_tables, lens, 0.125, **options
    )


def prefill_call(bad: bool = False, **options) -> None:
    key_cache, value_cache = caches()
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)
    lens = torch.tensor([4, 2], dtype=torch.int64 if bad else torch.int32)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    key, value = torch.randn(6, KV_HEADS, HEAD_DIM), torch.randn(6, KV_HEADS, HEAD_DIM)
    kernels.paged_prefill_attention(
        torch.randn(6, HEADS, HEAD_DIM), key_cache, value_cache, block_tables, starts, lens, 0.125,
        key=key, value=value, **options,
    )  # fmt: skip


def quantize_call(bad: bool = False) -> None:
    kernels.quantize_per_token(torch.randn(3, 64, 1) if bad else torch.randn(3, 64))


def weights(bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w_q, w_scale = kernels.quantize_weight_per_channel(torch.randn(128, 64))
    return w_q.t(), w_scale.half() if bad else w_scale


def linear_call(bad: bool = False) -> None:
    kernels.int8_linear(torch.randn(3, 64), *weights(bad))


def silu_mul_call(bad: bool = False) -> None:
    kernels.int8_linear_silu_mul(torch.randn(3, 64), *weights(bad))


def write_call(bad: bool = False) -> None:
    """An INT8 cache: the one the compiled writer takes."""
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = (torch.zeros(shape, dtype=torch.int8) for _ in range(2))
    key_scales, value_scales = (torch.ones(shape[:3]) for _ in range(2))
    slots = torch.tensor([0, 17, 40], dtype=torch.int32 if bad else torch.int64)
    kernels.write_kv_cache(
        torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM), key_cache, value_cache, slots,
        key_scales, value_scales,
    )  # fmt: skip


@dataclass(frozen=True)
class Op:
    call: Callable[..., None]
    module: ModuleType  # where the op looks up select_backend
    backends: dict[str, tuple[ModuleType, str]]  # backend -> the function that runs for it
    compiled_available: Callable[[], bool] | None = None
    has_compiled_flag: bool = False  # takes compiled=False
    loaders: tuple[ModuleType, ...] = field(default=())  # modules whose load_extension builds the kernel


OPS = {
    "paged_decode_attention": Op(
        decode_call,
        decode_attention,
        {
            "triton": (decode_attention, "paged_decode_attention_triton"),
            "compiled": (cpu_decode_attention, "paged_decode_attention_cpu"),
            "torch": (decode_attention, "paged_decode_attention_torch"),
        },
        cpu_decode_attention.available,
        True,
        (cpu_decode_attention,),
    ),
    "paged_prefill_attention": Op(
        prefill_call,
        prefill_attention,
        {
            "triton": (prefill_attention, "paged_prefill_attention_triton"),
            "compiled": (cpu_prefill_attention, "prefill_attention_cpu"),
            "torch": (prefill_attention, "paged_prefill_attention_torch"),  # also runs for "compiled"
        },
        lambda: cpu_prefill_attention.available(torch.float32),
        True,
        (cpu_prefill_attention,),
    ),
    "quantize_per_token": Op(
        quantize_call,
        int8_linear,
        {
            "triton": (int8_linear, "quantize_per_token_triton"),
            "compiled": (cpu_int8_linear, "quantize_per_token_cpu"),
            "torch": (int8_linear, "quantize_per_token_torch"),
        },
        cpu_int8_linear.available,
        loaders=(cpu_int8_linear,),
    ),
    "int8_linear": Op(
        linear_call,
        int8_linear,
        {
            "triton": (int8_linear, "int8_linear_triton"),
            "compiled": (cpu_int8_linear, "int8_linear_cpu"),
            "torch": (int8_linear, "int8_linear_torch"),
        },
        cpu_int8_linear.available,
        loaders=(cpu_int8_linear,),
    ),
    "int8_linear_silu_mul": Op(
        silu_mul_call,
        int8_linear,
        {
            "triton": (int8_linear, "int8_linear_triton"),
            "compiled": (cpu_int8_linear, "int8_linear_silu_mul_cpu"),
            "torch": (int8_linear, "int8_linear_torch"),
        },
        cpu_int8_linear.available,
        loaders=(cpu_int8_linear,),
    ),
    "write_kv_cache": Op(
        write_call,
        kv_cache,
        {
            "triton": (kv_cache, "write_kv_cache_triton"),
            "compiled": (kv_cache, "write_kv_cache_cpu"),
            "torch": (kv_cache, "write_kv_cache_torch"),
        },
        cpu_int8_linear.available,
        loaders=(cpu_int8_linear,),
    ),
}


def spy(monkeypatch: pytest.MonkeyPatch, op: Op) -> list[str]:
    """Wrap each backend's function; returns the backends that ran, in call order."""
    ran: list[str] = []
    for backend, (module, name) in op.backends.items():
        real = getattr(module, name)

        def recorded(*args, _backend=backend, _real=real, **kwargs):
            ran.append(_backend)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
    return ran


def backend_that_ran(ran: list[str]) -> str:
    # the compiled prefill kernel runs inside the torch path (paged_prefill_attention_torch calls it)
    return "compiled" if "compiled" in ran else ran[0]


def test_every_public_op_is_exported() -> None:
    assert set(OPS) <= set(kernels.__all__) and "select_backend" in kernels.__all__
    assert "quantize_weight_per_channel" in kernels.__all__


def test_select_backend_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2)
    assert select_backend(x) == "torch"
    assert select_backend(x, compiled_supports=lambda: True) == "compiled"
    assert select_backend(x, compiled_supports=lambda: False) == "torch"
    assert select_backend(x, compiled_supports=lambda: True, compiled=False) == "torch"
    monkeypatch.setattr("kernels._dispatch.use_triton", lambda tensor: True)  # a CUDA tensor, triton here
    assert select_backend(x, compiled_supports=lambda: True) == "triton"


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.compiled_available])
def test_cpu_tensors_run_the_compiled_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    op = OPS[name]
    if not op.compiled_available():
        pytest.skip("the compiled CPU kernel cannot be built here")
    ran = spy(monkeypatch, op)
    op.call()
    assert backend_that_ran(ran) == "compiled", ran


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.has_compiled_flag])
def test_compiled_false_runs_torch(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    op = OPS[name]
    ran = spy(monkeypatch, op)
    op.call(compiled=False)
    assert ran == ["torch"], ran


@pytest.mark.parametrize("name", list(OPS))
def test_freight_cpu_kernels_0_runs_torch(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    op = OPS[name]
    monkeypatch.setenv("FREIGHT_CPU_KERNELS", "0")
    for module in op.loaders:  # the variable is read when the extension loads: bypass the caches
        for name in ("load_extension", "available"):
            cached = getattr(module, name)
            if hasattr(cached, "__wrapped__"):
                monkeypatch.setattr(module, name, functools.partial(cached.__wrapped__))
    ran = spy(monkeypatch, op)
    op.call()
    assert ran == ["torch"], ran


@pytest.mark.parametrize(
    ("name", "backend"), [(name, backend) for name, op in OPS.items() for backend in op.backends]
)
def test_bad_arguments_are_refused_on_every_branch(
    monkeypatch: pytest.MonkeyPatch, name: str, backend: str
) -> None:
    op = OPS[name]
    monkeypatch.setattr(op.module, "select_backend", lambda *args, **kwargs: backend)
    ran = spy(monkeypatch, op)
    with pytest.raises(ValueError):
        op.call(bad=True)
    assert ran == [], ran


ATTENTION_OPS = ["paged_decode_attention", "paged_prefill_attention"]


@pytest.mark.parametrize("backend", ["triton", "compiled", "torch"])
@pytest.mark.parametrize("name", ATTENTION_OPS)
@pytest.mark.parametrize(
    "options",
    [dict(window=-1), dict(window=2.0), dict(window=True), dict(soft_cap=-1.0), dict(soft_cap=float("inf"))],
    ids=["window-negative", "window-float", "window-bool", "soft_cap-negative", "soft_cap-inf"],
)
def test_bad_attention_options_are_refused_on_every_branch(
    monkeypatch: pytest.MonkeyPatch, name: str, backend: str, options: dict
) -> None:
    op = OPS[name]
    monkeypatch.setattr(op.module, "select_backend", lambda *args, **kwargs: backend)
    ran = spy(monkeypatch, op)
    with pytest.raises(ValueError, match="window must be|soft_cap must be"):
        op.call(**options)
    assert ran == [], ran


def record_calls(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, result: Callable
) -> list[dict]:
    """Replace module.name by a recorder of its keyword arguments that returns result(*args)."""
    calls: list[dict] = []

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return result(*args)

    monkeypatch.setattr(module, name, recorded)
    return calls


# no option, each alone, both: what the attention ops pass on to their backends
ATTENTION_OPTIONS = [{}, dict(window=5), dict(soft_cap=30.0), dict(window=5, soft_cap=30.0)]


@pytest.mark.parametrize("options", ATTENTION_OPTIONS, ids=str)
@pytest.mark.parametrize("backend", ["triton", "compiled", "torch"])
def test_decode_passes_attention_options_to_its_backend(
    monkeypatch: pytest.MonkeyPatch, backend: str, options: dict
) -> None:
    """window and soft_cap reach the backend that runs; the compiled kernel gets them by keyword, and only
    when set (so that a build without them still serves plain attention)."""
    monkeypatch.setattr(decode_attention, "select_backend", lambda *args, **kwargs: backend)
    module, name = OPS["paged_decode_attention"].backends[backend]
    calls = record_calls(monkeypatch, module, name, lambda query, *rest: torch.zeros_like(query))
    decode_call(**options)
    if backend == "compiled":
        assert calls == [options]
    else:
        assert calls == [dict(window=0, soft_cap=0.0) | options]


@pytest.mark.parametrize("options", ATTENTION_OPTIONS, ids=str)
@pytest.mark.parametrize("backend", ["triton", "compiled", "torch"])
def test_prefill_passes_attention_options_to_its_backend(
    monkeypatch: pytest.MonkeyPatch, backend: str, options: dict
) -> None:
    """As for decode; the compiled prefill kernel runs inside the torch path, given the gathered contexts."""
    monkeypatch.setattr(prefill_attention, "select_backend", lambda *args, **kwargs: backend)
    monkeypatch.setattr(cpu_prefill_attention, "supports", lambda query, key: True)
    if backend == "compiled":
        calls = record_calls(monkeypatch, cpu_prefill_attention, "prefill_attention_cpu", lambda *args: None)
        prefill_call(**options)
        assert [{k: v for k, v in call.items() if k in ("window", "soft_cap")} for call in calls] == [options]
        return
    module, name = OPS["paged_prefill_attention"].backends[backend]
    calls = record_calls(monkeypatch, module, name, lambda query, *rest: torch.zeros_like(query))
    prefill_call(**options)
    assert [{k: call[k] for k in ("window", "soft_cap")} for call in calls] == [
        dict(window=0, soft_cap=0.0) | options
    ]
