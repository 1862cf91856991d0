"""A Llama-family decoder over packed token batches and a paged KV cache.

Plain tensors rather than nn.Modules: inference only, and fewer Python layers per op. The q/k/v
and gate/up projections are fused so each layer runs four matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import rms_norm
from worker.engine.attention import AttentionMetadata, KVCache
from worker.engine.config import ModelConfig
from worker.engine.quantization import Int8Backend, Linear, make_linear
from worker.engine.rope import RotaryEmbedding


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o_proj: Linear
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        quantization: str | None,
        device: torch.device,
        max_positions: int,
        int8_backend: Int8Backend | None = None,
        small_batch_rows: int = 0,  # INT8 products of at most this many rows take the small-batch kernel
        invariant_rows: int = 0,  # float products in fixed blocks of this many rows (quantization.FloatLinear)
        wide_rows: tuple[int, ...] = (),  # and in these wider blocks that round like them (layer projections)
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device

        def linear(
            weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
            wide: tuple[int, ...] = wide_rows,
        ) -> Linear:
            return make_linear(
                weight, bias, dtype, quantization, out_dtype, int8_backend, small_batch_rows, invariant_rows, wide
            )

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"checkpoint lacks tensor {name!r}")
            return tensors[name].to(device)

        self.embed = get("model.embed_tokens.weight").to(dtype)  # [vocab, hidden]
        self.norm = get("model.norm.weight").to(dtype)
        # tied models have no lm_head.weight, unless smoothing made one (its columns scaled, see smoothing.py)
        head = get("lm_head.weight") if "lm_head.weight" in tensors else self.embed  # [vocab, hidden]
        self.lm_head = linear(head, None, out_dtype=torch.float32, wide=())  # checked for layer shapes only
        self.layers: list[DecoderLayer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.attention_bias else None
            gate_up_w = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            self.layers.append(
                DecoderLayer(
                    input_norm=get(p + "input_layernorm.weight").to(dtype),
                    qkv=linear(qkv_w, qkv_b),
                    o_proj=linear(get(p + "self_attn.o_proj.weight"), None),
                    post_norm=get(p + "post_attention_layernorm.weight").to(dtype),
                    gate_up=linear(gate_up_w, None),
                    down=linear(get(p + "mlp.down_proj.weight"), None),
                )
            )
        self.rope = RotaryEmbedding(config, max_positions, dtype, device)
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qk_heads = config.num_heads + config.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        cfg = self.config
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed)
        rope = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps)
            qkv = layer.qkv(x)
            # queries and keys sit side by side in the fused output: one rotation for both
            qk = self.rope.apply(qkv[:, : self.q_size + self.kv_size].view(-1, self.qk_heads, cfg.head_dim), rope)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = kv_cache.attend(i, q, k, v, meta, self.scale)
            hidden = layer.o_proj(attn.reshape(-1, self.q_size), residual=hidden)
            x = rms_norm(hidden, layer.post_norm, eps)
            hidden = layer.down(layer.gate_up.silu_mul(x), residual=hidden)
        return rms_norm(hidden, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(hidden)
