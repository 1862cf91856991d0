"""Engine configuration: what the user asks for, and the model's shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobs.domain.engine_options import DTYPE_NAMES, EngineOptions

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class EngineConfig(EngineOptions):
    """What the user asks of the engine: the options of jobs.domain.engine_options.EngineOptions (their one
    declaration, which the worker settings derive from too), with the torch helpers the engine needs."""

    def kv_torch_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype once the compute dtype is known ("auto" follows it)."""
        if self.kv_cache_dtype == "int8":
            return torch.int8
        if self.kv_cache_dtype == "auto":
            return compute_dtype
        return DTYPES[self.kv_cache_dtype]


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma2", "gemma3_text")
SUPPORTED_MODEL_TYPES += ("qwen3_moe", "mixtral")  # mixture of experts (moe.py)
SUPPORTED_MODEL_TYPES += ("phi3",)  # Phi-3/3.5, Phi-4-mini: fused qkv and gate_up, partial rotary, LongRoPE
# checkpoints whose config nests the text decoder's (a multimodal wrapper: only its text tower loads)
TEXT_TOWERS = {"gemma3": "text_config"}
GEMMA_FAMILY = ("gemma2", "gemma3_text")  # (1 + w) norms, scaled embeddings, GeGLU, sandwich norms


def _rope_parameters(hf_config, layer_type: str | None) -> dict:
    """transformers 5 keeps rope settings in rope_parameters, per layer type where layers differ (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    return dict(params)


def _rope_theta_and_scaling(params: dict, fallback_theta: float | None) -> tuple[float, dict | None]:
    theta = params.get("rope_theta", fallback_theta if fallback_theta is not None else 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def _rotary(hf_config, params: dict, head_dim: int, scaling: dict | None) -> tuple[int | None, dict | None]:
    """(rotary_dim, rope_scaling): partial rotary on int(head_dim * partial_rotary_factor) dims, as transformers
    (Phi-4-mini: 0.75), None for all of them; LongRoPE's scaling given original_max_position_embeddings, which
    Phi-3 configs keep beside rope_scaling rather than in it."""
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0
    rotary_dim = int(head_dim * factor) if factor != 1.0 else None
    if rotary_dim is not None and (rotary_dim % 2 or not 0 < rotary_dim <= head_dim):
        raise ValueError(f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of {head_dim}: unsupported")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        original = scaling.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        scaling = scaling | {"original_max_position_embeddings": int(original)}
    return rotary_dim, scaling


def _layer_windows(hf_config, num_layers: int) -> tuple[int, ...]:
    """Per layer: its sliding window (keys a query sees, itself included), 0 for full attention."""
    window = getattr(hf_config, "sliding_window", None) or 0
    layer_types = getattr(hf_config, "layer_types", None)
    if not window:
        return (0,) * num_layers
    if layer_types is None:  # Mistral v0.1, Phi-3: one window for every layer
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)


def _moe_fields(hf_config, model_type: str, num_layers: int) -> dict:
    """ModelConfig's mixture-of-experts fields: Qwen3-MoE (layer i sparse when (i + 1) % decoder_sparse_step
    == 0 and i is not in mlp_only_layers, as transformers builds it) and Mixtral (every layer sparse, top-k
    weights always renormalised); {} for a dense family."""
    if model_type == "qwen3_moe":
        experts = int(getattr(hf_config, "num_experts", 0) or 0)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return dict(num_experts=experts, num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.moe_intermediate_size),
                    norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                    sparse_layers=sparse if any(sparse) else ())  # fmt: skip
    if model_type == "mixtral":
        experts = int(getattr(hf_config, "num_local_experts", None) or hf_config.num_experts)
        return dict(num_experts=experts, num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True,
                    sparse_layers=(True,) * num_layers)  # fmt: skip
    return {}


def model_type_of(hf_config) -> str:
    return getattr(hf_config, "model_type", "llama")


def text_config(hf_config):
    """The decoder's config: the config itself, or a multimodal checkpoint's text tower (Gemma 3)."""
    nested = TEXT_TOWERS.get(model_type_of(hf_config))
    return getattr(hf_config, nested) if nested else hf_config


@dataclass(frozen=True)
class ModelConfig:
    """Shape and family traits of a decoder (Llama, Mistral/Ministral, Qwen2/3, Gemma 2/3, Phi-3, MoE).

    One class for every family: each trait is a field whose default is Llama's, so a family is the set of
    traits it turns on (see from_hf)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    rope_scaling: dict | None = None  # HF rope parameters of a non-default rope ("llama3", "linear", ...)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before rope
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs before the residual
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full attention; () = all full
    local_rope_theta: float | None = None  # Gemma 3: the rope base of the window layers (default rope)
    attn_logit_softcap: float = 0.0  # Gemma 2: scores -> c * tanh(scores / c); 0: none
    final_logit_softcap: float = 0.0  # Gemma 2/3: logits -> c * tanh(logits / c); 0: none
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): rope on the first rotary_dim dims; None: all
    # mixture of experts (Qwen3-MoE, Mixtral): 0 experts = a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[bool, ...] = ()  # per layer: an MoE block (True) or a dense MLP; () = all dense

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Build from a transformers PretrainedConfig of a supported family (or a multimodal wrapper's text tower)."""
        hf_config = text_config(hf_config)
        model_type = model_type_of(hf_config)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: supported model types are {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = hf_config.num_attention_heads
        num_layers = hf_config.num_hidden_layers
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        gemma = model_type in GEMMA_FAMILY
        rope_params = _rope_parameters(hf_config, "full_attention")
        rope_theta, rope_scaling = _rope_theta_and_scaling(rope_params, getattr(hf_config, "rope_theta", None))
        rotary_dim, rope_scaling = _rotary(hf_config, rope_params, head_dim, rope_scaling)
        local_theta = None
        if model_type == "gemma3_text":
            local_theta, local_scaling = _rope_theta_and_scaling(_rope_parameters(hf_config, "sliding_attention"), 10000.0)
            if local_scaling is not None:
                raise ValueError(f"Gemma 3 window layers with rope scaling {local_scaling} are not supported")
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r} (silu and gelu_pytorch_tanh run)")
        query_scalar = getattr(hf_config, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            rope_scaling=rope_scaling,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            model_type=model_type,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            embed_scale=float(hf_config.hidden_size**0.5) if gemma else 1.0,
            hidden_act="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
            sandwich_norms=gemma,
            attention_scale=float(query_scalar) ** -0.5 if query_scalar else None,
            layer_windows=_layer_windows(hf_config, num_layers),
            local_rope_theta=local_theta,
            attn_logit_softcap=float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0),
            final_logit_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
            rotary_dim=rotary_dim,
            **_moe_fields(hf_config, model_type, num_layers),
        )
