"""Write a tiny HF model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does, for tests.

A user's GGUF comes from that converter, so the file holds what it writes and no more: per family its
metadata keys (TextModel.set_gguf_parameters plus the family class's own), its tensor layout (q/k rows
permuted for the llama architecture, Gemma norms stored as 1 + w, MoE experts stacked into 3-D
`ffn_*_exps`, Phi-3's fused `attn_qkv` / `ffn_up`, Llama 3's `rope_freqs` and Phi-3's LongRoPE factor
tensors) and a GPT-2 style vocabulary. Families whose features llama.cpp cannot express are built with the
value llama.cpp assumes (GGUF_VARIANTS; the limits are listed in docs/models.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker.engine.families import FAMILIES, Family, build_family

F32 = gguf.GGMLQuantizationType.F32
Q8_0 = gguf.GGMLQuantizationType.Q8_0
FILE_TYPES = {F32: gguf.LlamaFileType.ALL_F32, Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
NORM_GRID = 2.0**-16  # Gemma norms on this grid survive llama.cpp's float32 (1 + w) - 1 round trip exactly


def _variant(name: str, **options: Any) -> Family:
    family = FAMILIES[name]
    return dataclasses.replace(family, options=family.options | options)


# Each family as a GGUF can hold it: where llama.cpp's conventions cannot express a feature, the value
# llama.cpp assumes (why, per family: docs/models.md, "GGUF").
GGUF_VARIANTS: dict[str, Family] = {
    name: FAMILIES[name] for name in ("llama3", "qwen2", "qwen3", "phi3", "phi3_mini")
} | {
    # the llama architecture (Mistral, Mixtral) has no sliding window in llama.cpp
    "mistral": _variant("mistral", sliding_window=None),
    "mixtral": _variant("mixtral", sliding_window=None),
    # llama.cpp scales Gemma's queries by head_dim ** -0.5 (hidden / heads for the 27B models only)
    "gemma2": _variant("gemma2", query_pre_attn_scalar=32),
    # ... and hard-codes Gemma 3's five window layers to one global layer
    "gemma3": _variant("gemma3", query_pre_attn_scalar=32, num_hidden_layers=6, layer_types=None),
    # llama.cpp's qwen3moe has experts in every layer
    "qwen3_moe": _variant("qwen3_moe", mlp_only_layers=[]),
}


def build_gguf_family(name: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    """The HF folder of GGUF_VARIANTS[name] (build_family's model; Gemma norms put on NORM_GRID)."""
    family = GGUF_VARIANTS[name]
    build_family(family, out_dir, tokenizer_dir)
    if family.config_class.model_type in ("gemma2", "gemma3_text"):
        path = out_dir / "model.safetensors"
        tensors = load_file(str(path))
        for key, tensor in tensors.items():
            if key.endswith("norm.weight"):
                tensors[key] = (tensor / NORM_GRID).round() * NORM_GRID
        save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


# --- metadata, as the converter's set_gguf_parameters writes it --------------------------------------


def _full_rope(config: Any) -> dict:
    params = dict(config.rope_parameters or {})
    return dict(params.get("full_attention", params))


def _head_dim(config: Any) -> int | None:
    """head_dim as config.json states it (llama.cpp reads hparams["head_dim"] only when present)."""
    return config.to_dict().get("head_dim")


def _base_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """TextModel.set_gguf_parameters."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    rope = _full_rope(c)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    w.add_rope_freq_base(rope["rope_theta"])
    sliding = (c.rope_parameters or {}).get("sliding_attention")
    if sliding:
        w.add_rope_freq_base_swa(sliding["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if (head_dim := _head_dim(c)) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _llama_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """LlamaModel (Llama, Mistral, Mixtral): the vocabulary size and head_dim as the rope dimension."""
    _base_metadata(w, c)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(_head_dim(c) or c.hidden_size // c.num_attention_heads)


def _qwen3moe_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """Qwen2MoeModel: the experts' intermediate size."""
    _base_metadata(w, c)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)


def _phi3_rope(c: Any) -> tuple[dict, int, int]:
    rope = _full_rope(c)
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
    return rope, rope_dims, rope["original_max_position_embeddings"]


def _phi3_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """Phi3MiniModel (its own keys, not the base class's): partial rotary as the rope dimension count,
    LongRoPE's original context and attention factor (the factors themselves are tensors)."""
    rope, rope_dims, original = _phi3_rope(c)
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)  # 0: none (Phi-4)
    if rope.get("long_factor"):
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _gemma2_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """Gemma2Model (its own keys): soft-capping and the window; no rope base (llama.cpp's default 10000)."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


def _gemma3_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """Gemma3Model: the base keys (with the window layers' rope base) plus the window."""
    _base_metadata(w, c)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


@dataclass(frozen=True)
class Convention:
    """How llama.cpp's converter writes one family."""

    arch: gguf.MODEL_ARCH
    metadata: Callable[[gguf.GGUFWriter, Any], None]
    permute_qk: bool = False  # LlamaModel: q/k rows reordered for llama.cpp's rope
    norm_shift: float = 0.0  # Gemma: norms stored as 1 + w


CONVENTIONS: dict[str, Convention] = {
    "llama": Convention(gguf.MODEL_ARCH.LLAMA, _llama_metadata, permute_qk=True),
    "mistral": Convention(gguf.MODEL_ARCH.LLAMA, _llama_metadata, permute_qk=True),
    "mixtral": Convention(gguf.MODEL_ARCH.LLAMA, _llama_metadata, permute_qk=True),
    "qwen2": Convention(gguf.MODEL_ARCH.QWEN2, _base_metadata),
    "qwen3": Convention(gguf.MODEL_ARCH.QWEN3, _base_metadata),
    "qwen3_moe": Convention(gguf.MODEL_ARCH.QWEN3MOE, _qwen3moe_metadata),
    "phi3": Convention(gguf.MODEL_ARCH.PHI3, _phi3_metadata),
    "gemma2": Convention(gguf.MODEL_ARCH.GEMMA2, _gemma2_metadata, norm_shift=1.0),
    "gemma3_text": Convention(gguf.MODEL_ARCH.GEMMA3, _gemma3_metadata, norm_shift=1.0),
}


# --- tensors ---------------------------------------------------------------------------------------------


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rows from halves (HF's rotate_half) to interleaved pairs (llama.cpp)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _file_layout(convention: Convention, config: Any, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF-style name the tensor map knows, tensor as stored) for one HF tensor."""
    if convention.norm_shift and name.endswith("norm.weight"):
        tensor = tensor + convention.norm_shift
    if convention.permute_qk and name.endswith("q_proj.weight"):
        tensor = _permute(tensor, config.num_attention_heads)
    if convention.permute_qk and name.endswith("k_proj.weight"):
        tensor = _permute(tensor, config.num_key_value_heads)
    if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5 fuses the experts: [E, 2I, H]
        gate, up = tensor.chunk(2, dim=1)
        yield name.replace("gate_up_proj", "gate_proj.weight"), gate
        yield name.replace("gate_up_proj", "up_proj.weight"), up
    elif name.endswith("mlp.experts.down_proj"):
        yield name + ".weight", tensor
    else:
        yield name, tensor


def _extra_tensors(config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors the converter derives from the config: Llama 3's rope_freqs, Phi-3's LongRoPE factors."""
    rope = _full_rope(config)
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_rope_factors(config, rope)
    if config.model_type == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


def _llama3_rope_factors(config: Any, rope: dict) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: the per-frequency divisor of Llama 3's rope."""
    dim = _head_dim(config) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _quantizable(gguf_name: str, array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> bool:
    """The converter keeps 1-D tensors and the MoE router in F32; a row that is not a whole number of blocks
    cannot be quantized (the converter falls back to a float type)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype != F32 and array.ndim >= 2 and array.shape[-1] % block == 0 and ".ffn_gate_inp." not in gguf_name


# --- vocabulary ------------------------------------------------------------------------------------------


def _add_vocab(w: gguf.GGUFWriter, tokenizer_dir: Path, vocab_size: int) -> None:
    """TextModel._set_vocab_gpt2: tokens by id (padded to the model's vocabulary), their types, BPE merges,
    special ids and the chat template."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    merges = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"]
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = {token.content: token for token in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            special = token in added and added[token].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED if token in added else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for setter, token_id in ((w.add_bos_token_id, tokenizer.bos_token_id), (w.add_eos_token_id, tokenizer.eos_token_id),
                             (w.add_unk_token_id, tokenizer.unk_token_id), (w.add_pad_token_id, tokenizer.pad_token_id)):
        if token_id is not None:
            setter(token_id)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)


# --- the file --------------------------------------------------------------------------------------------


def write_gguf(model_dir: Path, out_path: Path, qtype: gguf.GGMLQuantizationType = F32) -> dict[str, torch.Tensor]:
    """Write the HF model at `model_dir` as llama.cpp's converter would (F32 or Q8_0). Returns the HF state
    dict the file encodes: the model's own tensors, each quantized one as Q8_0 rounds it (row-wise blocks,
    which the layout's row permutations and expert splits leave intact)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    convention = CONVENTIONS[config.model_type]
    name_map = gguf.get_tensor_name_map(convention.arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[convention.arch])
    writer.add_name(f"Tiny {model_dir.name}")
    convention.metadata(writer, config)
    writer.add_file_type(FILE_TYPES[qtype])
    _add_vocab(writer, model_dir, config.vocab_size)

    encoded = {}
    tied = config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # not in a tied checkpoint's files
        tensor = tensor.detach().float()
        quantized = False
        for hf_name, stored in _file_layout(convention, config, name, tensor):
            base, _, suffix = hf_name.rpartition(".")
            if (mapped := name_map.get_name(base)) is None:
                raise ValueError(f"no GGUF name for {hf_name} in {convention.arch.name}")
            gguf_name = f"{mapped}.{suffix}"
            array = stored.contiguous().numpy()
            quantized = _quantizable(gguf_name, array, qtype)
            if quantized:
                writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, array.astype(np.float32))
        encoded[name] = _as_encoded(tensor, quantized, qtype, convention.norm_shift if name.endswith("norm.weight") else 0.0)
    for gguf_name, tensor in _extra_tensors(config):
        writer.add_tensor(gguf_name, tensor.numpy())

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return encoded


def _as_encoded(tensor: torch.Tensor, quantized: bool, qtype: gguf.GGMLQuantizationType, shift: float) -> torch.Tensor:
    """The HF tensor a reader gets back from the file."""
    if quantized:
        array = tensor.contiguous().numpy()
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).copy())
    return (tensor + shift) - shift if shift else tensor
