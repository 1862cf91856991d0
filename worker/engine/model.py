"""One decoder for every supported family, over packed token batches and a paged KV cache.

Plain tensors rather than nn.Modules: inference only, and fewer Python layers per op. The q/k/v and
gate/up projections are fused so each layer runs four matrix products. Family traits are ModelConfig
fields (config.py); the weights arrive in weights.py's canonical layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels import rms_norm
from worker.engine.attention import AttentionMetadata, KVCache
from worker.engine.config import ModelConfig
from worker.engine.moe import MoEBlock
from worker.engine.quantization import FloatLinear, Int8Backend, Linear, gated, make_linear
from worker.engine.rope import RotaryEmbedding


@dataclass
class DecoderLayer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o_proj: Linear
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear | None  # hidden -> 2 * intermediate (None on a sparse layer)
    down: Linear | None
    rope: RotaryEmbedding  # the global one, or Gemma 3's local one on window layers
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden] (Gemma's sandwich norms)
    mlp_out_norm: torch.Tensor | None = None
    moe: MoEBlock | None = None  # sparse (MoE) layers: the block that replaces gate_up and down (moe.py)


class DecoderModel:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],  # canonical layout (weights.py)
        dtype: torch.dtype,
        quantization: str | None,
        device: torch.device,
        max_positions: int,
        int8_backend: Int8Backend | None = None,
        small_batch_rows: int = 0,  # INT8 products of at most this many rows take the small-batch kernel
        invariant_rows: int = 0,  # float products in fixed blocks of this many rows (quantization.FloatLinear)
        wide_rows: tuple[int, ...] = (),  # and in these wider blocks that round like them (layer projections)
        greedy_head: bool = False,  # greedy picks inside an INT8 LM head on CPU (greedy_picks), where it can
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device

        def linear(
            weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
            wide: tuple[int, ...] = wide_rows, gated: bool = False, keep_codes: bool = False,
        ) -> Linear:
            return make_linear(
                weight.to(device), None if bias is None else bias.to(device), dtype, quantization, out_dtype,
                int8_backend, small_batch_rows, invariant_rows, wide, gated, keep_codes,
            )

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"checkpoint lacks tensor {name!r}")
            return tensors[name].to(device)

        def optional(name: str) -> torch.Tensor | None:
            return get(name).to(dtype) if name in tensors else None

        silu = config.hidden_act == "silu"  # the gate/up products are then only used through gated_mul

        def moe_block(p: str) -> MoEBlock:
            """A sparse layer's router (float32, like transformers' router logits) and per-expert linears, each
            its own product (INT8: its own per-channel scales, GEMM and small-batch path)."""
            gate_up, down = get(p + "experts.gate_up"), get(p + "experts.down")
            return MoEBlock(
                FloatLinear(get(p + "router"), None, torch.float32, torch.float32, invariant_rows, wide_rows),
                [linear(w, None, gated=silu) for w in gate_up.unbind(0)], [linear(w, None) for w in down.unbind(0)],
                config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act,
            )  # fmt: skip

        self.embed = get("embed").to(dtype)  # [vocab, hidden]
        # Gemma scales embeddings by sqrt(hidden) rounded to the compute dtype, as transformers does
        self.embed_scale = (
            torch.tensor(config.embed_scale, dtype=torch.float32).to(dtype) if config.embed_scale != 1.0 else None
        )
        self.norm = get("norm").to(dtype)
        # tied models have no lm_head, unless smoothing made one (its columns scaled, see plan/smoothing.py)
        head = get("lm_head") if "lm_head" in tensors else self.embed  # [vocab, hidden]
        # a soft-cap can round distinct logits to one value (tanh saturates), so its argmax is the logits' own
        greedy_head = greedy_head and not config.final_logit_softcap
        self.lm_head = linear(head, None, out_dtype=torch.float32, wide=(), keep_codes=greedy_head)
        # greedy rows pick their token in the head's product: no [rows, vocab] logits written and read back
        self.fused_greedy = greedy_head and not isinstance(self.lm_head, FloatLinear) and self.lm_head.picks_greedy
        global_rope = RotaryEmbedding(config, max_positions, dtype, device)
        local_rope = global_rope
        if config.local_rope_theta is not None:
            local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            local_rope = RotaryEmbedding(local, max_positions, dtype, device)
        self.ropes = [global_rope] if local_rope is global_rope else [global_rope, local_rope]
        self.layers: list[DecoderLayer] = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            self.layers.append(
                DecoderLayer(
                    attn_norm=get(p + "attn_norm").to(dtype),
                    qkv=linear(get(p + "qkv"), tensors.get(p + "qkv_bias")),
                    o_proj=linear(get(p + "o_proj"), None),
                    mlp_norm=get(p + "mlp_norm").to(dtype),
                    gate_up=None if config.is_sparse(i) else linear(get(p + "gate_up"), None, gated=silu),
                    down=None if config.is_sparse(i) else linear(get(p + "down"), None),
                    rope=local_rope if config.window(i) else global_rope,
                    q_norm=optional(p + "q_norm"),
                    k_norm=optional(p + "k_norm"),
                    attn_out_norm=optional(p + "attn_out_norm"),
                    mlp_out_norm=optional(p + "mlp_out_norm"),
                    moe=moe_block(p) if config.is_sparse(i) else None,
                )
            )
        self.scale = config.softmax_scale
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
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        tables = {id(rope): rope.tables(positions) for rope in self.ropes}  # gathered once per step
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.qkv.normed(hidden, layer.attn_norm, eps))
            q, k = self._rotated(layer, qkv, tables[id(layer.rope)])
            v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = kv_cache.attend(i, q, k, v, meta, self.scale).reshape(-1, self.q_size)
            if layer.attn_out_norm is None:
                hidden = layer.o_proj(attn, residual=hidden)
            else:
                hidden = hidden + rms_norm(layer.o_proj(attn), layer.attn_out_norm, eps)
            if layer.moe is not None:  # sparse layer (no family has both experts and sandwich norms)
                hidden = layer.moe(rms_norm(hidden, layer.mlp_norm, eps), residual=hidden)
                continue
            x = layer.gate_up.normed(hidden, layer.mlp_norm, eps)  # the codes themselves on the AMX path
            if layer.mlp_out_norm is None:
                hidden = layer.down(gated(layer.gate_up, x, cfg.hidden_act), residual=hidden)
            else:
                hidden = hidden + rms_norm(layer.down(gated(layer.gate_up, x, cfg.hidden_act)), layer.mlp_out_norm, eps)
        return rms_norm(hidden, self.norm, eps)

    def _rotated(
        self, layer: DecoderLayer, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]
        cfg = self.config
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.qk_heads, cfg.head_dim)
        if layer.q_norm is None:
            # queries and keys sit side by side in the fused output: one rotation for both
            return layer.rope.apply(qk, tables).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)  # per head, before rope (Qwen3, Gemma 3)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        return layer.rope.apply(q, tables), layer.rope.apply(k, tables)

    def greedy_picks(self, hidden: torch.Tensor) -> list[int]:  # [n, hidden] -> n token ids
        """Each row's first maximal logit's index, as logits(hidden).max(-1) gives it (only if fused_greedy)."""
        return self.lm_head.argmax(hidden).tolist()  # type: ignore[union-attr]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap:  # Gemma: c * tanh(logits / c), transformers' order of operations
            logits = torch.tanh(logits / cap) * cap
        return logits
