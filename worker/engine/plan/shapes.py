"""The products a layer runs, with their shapes: the one place they are derived from a model's config.

The canonical tensors (weights.canonical_shapes), the small-batch measurement (small_batch.py) and the
batch-invariance check (invariance.py) all read them here, so they cannot disagree on a model's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.config import ModelConfig


@dataclass(frozen=True)
class Product:
    """One weight product: y[rows, out_features] = x[rows, in_features] @ weight[out_features, in_features]^T."""

    name: str  # the canonical tensor's name within its layer (weights.py)
    out_features: int  # N
    in_features: int  # K

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's shape [N, K]."""
        return self.out_features, self.in_features


def layer_products(model: ModelConfig) -> list[Product]:
    """A dense layer's four products: fused qkv, o_proj, fused gate/up, down."""
    h, i, d = model.hidden_size, model.intermediate_size, model.head_dim
    return [
        Product("qkv", (model.num_heads + 2 * model.num_kv_heads) * d, h),
        Product("o_proj", h, model.num_heads * d),
        Product("gate_up", 2 * i, h),
        Product("down", h, i),
    ]


def expert_products(model: ModelConfig) -> list[Product]:
    """A sparse (MoE) layer's router, and one expert's fused gate/up and down; [] for a dense model."""
    if not model.num_experts:
        return []
    h, mi = model.hidden_size, model.moe_intermediate_size
    return [Product("router", model.num_experts, h), Product("experts.gate_up", 2 * mi, h),
            Product("experts.down", h, mi)]  # fmt: skip


def lm_head(model: ModelConfig) -> Product:
    return Product("lm_head", model.vocab_size, model.hidden_size)
