"""A checkpoint's tensors, whatever its family, under the one layout the decoder reads.

Families name and split the same weights differently (Llama's post_attention_layernorm is the norm before
the MLP, Gemma's is the norm after attention; Phi-3 ships q/k/v fused); the decoder (model.py) and the
smoothing pass (plan/smoothing.py) read one canonical layout instead, built here once at load:

    embed [vocab, hidden]            norm [hidden]            lm_head [vocab, hidden] (absent when tied)
    layers.{i}.attn_norm [hidden]    qkv [(heads + 2 * kv_heads) * head_dim, hidden]    qkv_bias (Qwen2)
    layers.{i}.q_norm, k_norm [head_dim] (Qwen3, Gemma 3)    o_proj [hidden, heads * head_dim]
    layers.{i}.attn_out_norm, mlp_out_norm [hidden] (Gemma's sandwich norms)    mlp_norm [hidden]
    layers.{i}.gate_up [2 * intermediate, hidden] (gate rows, then up rows)    down [hidden, intermediate]
    sparse (MoE) layers instead of gate_up and down (moe.py):    layers.{i}.router [experts, hidden]
    layers.{i}.experts.gate_up [experts, 2 * moe_intermediate, hidden] (per expert: gate rows, then up rows)
    layers.{i}.experts.down [experts, hidden, moe_intermediate]

Experts come in two checkpoint layouts, both read: one tensor per expert and projection, as hub checkpoints
(and transformers' save_pretrained) store them (Qwen3-MoE: mlp.experts.{e}.gate_proj/up_proj/down_proj,
Mixtral: block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)), or transformers 5's fused 3-D
in-memory layout (mlp.experts.gate_up_proj [experts, 2 * moe_intermediate, hidden], mlp.experts.down_proj).

Gemma stores its RMSNorm weights as w and applies (1 + w) in float32: the canonical norm is 1 + w,
computed once here the same way, so every family runs one RMSNorm.
"""

from __future__ import annotations

import torch

from worker.engine.config import ModelConfig
from worker.engine.plan.shapes import expert_products, layer_products, lm_head


def _prefix(tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    """(decoder prefix, LM-head name): "model." for a causal LM, the text tower's for a multimodal wrapper."""
    for prefix, head in (
        ("model.", "lm_head.weight"),
        ("model.language_model.", "lm_head.weight"),
        ("language_model.model.", "language_model.lm_head.weight"),
    ):
        if prefix + "embed_tokens.weight" in tensors:
            return prefix, head
    raise ValueError("checkpoint has no embed_tokens.weight under model., model.language_model. or language_model.model.")


def hf_layer_names(config: ModelConfig, layer: int, prefix: str = "model.") -> dict[str, str | list[str]]:
    """Canonical name -> the checkpoint tensor(s) it is made of (several: concatenated in order)."""
    p = f"{prefix}layers.{layer}."
    names: dict[str, str | list[str]] = {
        "attn_norm": p + "input_layernorm.weight",
        "qkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
        "o_proj": p + "self_attn.o_proj.weight",
        "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "down": p + "mlp.down_proj.weight",
    }
    if config.is_sparse(layer):  # an MoE block instead of the dense MLP: _moe_names
        names.pop("gate_up", None)
        names.pop("down", None)
    if config.model_type == "phi3":  # shipped fused, in the canonical order (q, k, v rows; gate, then up rows)
        names |= {"qkv": p + "self_attn.qkv_proj.weight", "gate_up": p + "mlp.gate_up_proj.weight"}
    if config.sandwich_norms:
        names |= {
            "attn_out_norm": p + "post_attention_layernorm.weight",
            "mlp_norm": p + "pre_feedforward_layernorm.weight",
            "mlp_out_norm": p + "post_feedforward_layernorm.weight",
        }
    else:
        names["mlp_norm"] = p + "post_attention_layernorm.weight"
    if config.attention_bias:
        names["qkv_bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    if config.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    return names


def _moe_names(config: ModelConfig, layer: int, prefix: str, tensors) -> dict[str, list[str]]:
    """A sparse layer's router and expert tensors in the layout the checkpoint has: {"router": [name],
    "gate_up": [fused] or per expert [gate, up, gate, up, ...], "down": [fused] or per expert}."""
    p = f"{prefix}layers.{layer}."
    blocks = ("block_sparse_moe.", "mlp.") if config.model_type == "mixtral" else ("mlp.",)
    block = next((b for b in blocks if p + b + "gate.weight" in tensors or p + b + "experts.down_proj" in tensors),
                 blocks[0])  # fmt: skip
    b = p + block
    if b + "experts.gate_up_proj" in tensors:  # transformers 5's fused layout (MergeModulelist + Concatenate)
        return {"router": [b + "gate.weight"], "gate_up": [b + "experts.gate_up_proj"], "down": [b + "experts.down_proj"]}
    gate, up, down = ("w1", "w3", "w2") if config.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    experts = range(config.num_experts)
    return {
        "router": [b + "gate.weight"],
        "gate_up": [b + f"experts.{e}.{n}.weight" for e in experts for n in (gate, up)],
        "down": [b + f"experts.{e}.{down}.weight" for e in experts],
    }


def missing_tensor_names(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Checkpoint tensors the decoder needs and `tensors` lacks (the loader checks before building anything)."""
    try:
        prefix, head = _prefix(tensors)
    except ValueError:
        return ["model.embed_tokens.weight"]
    names = [prefix + "embed_tokens.weight", prefix + "norm.weight"]
    if not config.tie_word_embeddings:
        names.append(head)
    for i in range(config.num_layers):
        for parts in hf_layer_names(config, i, prefix).values():
            names += parts if isinstance(parts, list) else [parts]
        if config.is_sparse(i):
            names += [n for parts in _moe_names(config, i, prefix, tensors).values() for n in parts]
    return sorted(set(names) - tensors.keys())


def _is_norm(name: str) -> bool:
    return name == "norm" or name.endswith("_norm")


def canonical_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the canonical layout (module docstring); fused ones are new tensors."""
    prefix, head = _prefix(tensors)
    gemma_norms = config.sandwich_norms  # the Gemma family: every RMSNorm weight is applied as (1 + w)

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return tensors[name]

    def norm(weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.float() if gemma_norms else weight

    out = {"embed": get(prefix + "embed_tokens.weight"), "norm": norm(get(prefix + "norm.weight"))}
    if head in tensors and not config.tie_word_embeddings:
        out["lm_head"] = tensors[head]
    for i in range(config.num_layers):
        for name, parts in hf_layer_names(config, i, prefix).items():
            tensor = torch.cat([get(n) for n in parts]) if isinstance(parts, list) else get(parts)
            out[f"layers.{i}.{name}"] = norm(tensor) if _is_norm(name) else tensor
        if config.is_sparse(i):
            out |= _canonical_moe(config, i, prefix, tensors, get)
    return out


def _canonical_moe(config: ModelConfig, layer: int, prefix: str, tensors, get) -> dict[str, torch.Tensor]:
    names = _moe_names(config, layer, prefix, tensors)
    p = f"layers.{layer}."
    out = {p + "router": get(names["router"][0])}
    if names["down"][0].endswith("experts.down_proj"):  # the fused layout: already canonical
        out |= {p + "experts.gate_up": get(names["gate_up"][0]), p + "experts.down": get(names["down"][0])}
    else:  # per expert: [gate_e; up_e] stacked over experts
        parts = [get(n) for n in names["gate_up"]]
        out[p + "experts.gate_up"] = torch.stack([torch.cat(parts[2 * e : 2 * e + 2]) for e in range(config.num_experts)])
        out[p + "experts.down"] = torch.stack([get(n) for n in names["down"]])
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for name, shape in ((p + "router", (e, h)), (p + "experts.gate_up", (e, 2 * i, h)), (p + "experts.down", (e, h, i))):
        if tuple(out[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, the checkpoint has {tuple(out[name].shape)}")
    return out


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the canonical tensors (plan/schemes.py times random layers of a model's real shapes); the
    products' shapes come from plan/shapes.py."""
    h, d = config.hidden_size, config.head_dim
    products = {p.name: p.shape for p in layer_products(config)}
    experts = {p.name: p.shape for p in expert_products(config)}
    qkv_rows = products["qkv"][0]
    shapes: dict[str, tuple[int, ...]] = {"embed": lm_head(config).shape, "norm": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = lm_head(config).shape
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        # in the order random models fill them (worker/bench/random_model.py draws from one generator)
        shapes |= {p + "attn_norm": (h,), p + "qkv": products["qkv"], p + "o_proj": products["o_proj"],
                   p + "mlp_norm": (h,), p + "gate_up": products["gate_up"], p + "down": products["down"]}  # fmt: skip
        if config.is_sparse(layer):
            e = config.num_experts
            del shapes[p + "gate_up"], shapes[p + "down"]
            shapes |= {p + "router": experts["router"]}
            shapes |= {p + name: (e, *s) for name, s in experts.items() if name != "router"}
        if config.sandwich_norms:
            shapes |= {p + "attn_out_norm": (h,), p + "mlp_out_norm": (h,)}
        if config.attention_bias:
            shapes[p + "qkv_bias"] = (qkv_rows,)
        if config.qk_norm:
            shapes |= {p + "q_norm": (d,), p + "k_norm": (d,)}
    return shapes
