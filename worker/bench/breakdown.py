"""Where a step's time goes: attention, MLP/experts, the q/k/v and o projections, the LM head, the rest,
for decode steps and for steps that run a prefill chunk, each summed apart.

Installed by the bench only (`freight bench --breakdown`), on one loaded LLM: timing wrappers around the
engine's step, the model's forward, the KV cache's `attend` and each layer's projections and MLP (or MoE
block). The engine's own code path is untouched. On CPU every op is synchronous, so wall-clock time around
a call is its cost; the wrappers add a few perf_counter calls per layer (microseconds against steps of
tens of milliseconds).

A step is a decode step when it runs no prefill chunk (speculative drafts verified in it count as decode);
every other step is a prefill step (its decode rows included: they ride in the same forward).
MLP time runs from the gate/up product's start to the down product's end, so it holds the activation;
`lm_head` is the head's product (its logits, or the fused greedy picks); `rest` is the step's time outside
these: embeddings, norms, rope, sampling, scheduling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PARTS = ("step", "forward", "attention", "mlp", "projections", "lm_head")


def _summary(seconds: dict[str, float], steps: int, prefix: str) -> dict[str, Any]:
    step = max(seconds["step"], 1e-12)
    parts = ("attention", "mlp", "projections", "lm_head")
    shares = {name: seconds[name] for name in parts}
    shares["rest"] = seconds["step"] - sum(shares.values())
    shares["outside_forward"] = seconds["step"] - seconds["forward"]
    return {
        f"{prefix}_steps": steps,
        f"{prefix}_seconds": round(seconds["step"], 3),
        "shares": {name: round(value / step, 4) for name, value in shares.items()},
        "seconds": {name: round(value, 3) for name, value in shares.items()},
    }


@dataclass
class Breakdown:
    decode_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    prefill_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    decode_steps: int = 0
    prefill_steps: int = 0
    decode: bool = False  # the step being timed is a decode step
    ran: bool = False  # the step being timed ran the model
    _mlp_started: float = 0.0

    def add(self, part: str, seconds: float) -> None:
        (self.decode_seconds if self.decode else self.prefill_seconds)[part] += seconds

    def as_dict(self) -> dict[str, Any]:  # the decode steps' summary
        return _summary(self.decode_seconds, self.decode_steps, "decode")

    def prefill_dict(self) -> dict[str, Any]:  # the same for the steps that run a prefill chunk
        return _summary(self.prefill_seconds, self.prefill_steps, "prefill")


class _Timed:
    """A callable's stand-in that adds its time to one part; other attributes go to the callable."""

    def __init__(self, inner: Any, part: str, breakdown: Breakdown) -> None:
        self._inner, self._part, self._breakdown = inner, part, breakdown

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._breakdown.add(self._part, time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _MLPStart(_Timed):
    """The gate/up product: notes when the MLP starts (its fused gated_mul path included)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._breakdown._mlp_started = time.perf_counter()
        return self._inner(*args, **kwargs)

    def gated_mul(self, *args: Any, **kwargs: Any) -> Any:
        self._breakdown._mlp_started = time.perf_counter()
        return self._inner.gated_mul(*args, **kwargs)


class _MLPEnd(_Timed):
    """The down product: adds the time since the gate/up product started to the MLP."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._breakdown.add("mlp", time.perf_counter() - self._breakdown._mlp_started)


def install(llm: Any) -> Breakdown:
    """Wrap `llm`'s engine step, forward, attention and layers; return the Breakdown they fill."""
    breakdown = Breakdown()
    engine = llm.engine
    model, kv_cache = engine.model, engine.kv_cache
    step, forward, attend = engine.step, model.forward, kv_cache.attend

    def timed_step() -> Any:
        breakdown.decode, breakdown.ran = False, False
        started = time.perf_counter()
        result = step()
        if not breakdown.ran:  # nothing to run (all rows waiting): not a step of either kind
            return result
        breakdown.add("step", time.perf_counter() - started)
        if breakdown.decode:
            breakdown.decode_steps += 1
        else:
            breakdown.prefill_steps += 1
        return result

    def timed_forward(input_ids: Any, positions: Any, meta: Any, cache: Any) -> Any:
        breakdown.decode = meta.prefill_block_tables is None and meta.num_decode_tokens > 0
        breakdown.ran = True
        started = time.perf_counter()
        try:
            return forward(input_ids, positions, meta, cache)
        finally:
            breakdown.add("forward", time.perf_counter() - started)

    engine.step = timed_step
    model.forward = timed_forward
    model.logits = _Timed(model.logits, "lm_head", breakdown)
    model.greedy_picks = _Timed(model.greedy_picks, "lm_head", breakdown)
    kv_cache.attend = _Timed(attend, "attention", breakdown)
    for layer in model.layers:
        layer.qkv = _Timed(layer.qkv, "projections", breakdown)
        layer.o_proj = _Timed(layer.o_proj, "projections", breakdown)
        if layer.moe is not None:
            layer.moe = _Timed(layer.moe, "mlp", breakdown)
        else:
            layer.gate_up = _MLPStart(layer.gate_up, "mlp", breakdown)
            layer.down = _MLPEnd(layer.down, "mlp", breakdown)
    return breakdown
