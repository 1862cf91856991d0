"""SmoothQuant-style smoothing before INT8 quantization, calibrated at load time on a shipped text.

Per-token INT8 activations lose the small values of a token when a few channels carry huge ones (the
input of down_proj reaches thousands in SmolLM2 while most entries are below ten), since one scale per
token must cover its largest entry. Smoothing divides input channel j by s_j and multiplies the weight's
column j by s_j, which leaves the product unchanged in exact arithmetic but moves the outliers' range
into the weights, where per-output-channel scales absorb it:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

The 1 / s_j is folded into what produces the input, so no extra op runs: the RMSNorm weight before
qkv and gate_up, the up rows of gate_up before down (silu(gate) * up is linear in up), and the final
norm before the LM head (a tied head then gets a scaled copy of the embeddings). max|X_j|
comes from one float forward pass over calibration.txt beside this file; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.engine.attention import AttentionMetadata, KVCache
from worker.engine.config import ModelConfig

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
ALPHA = 0.5  # SmoothQuant's default migration strength
MIN_SCALE = 1e-5  # keeps s_j finite for channels that never fire


@dataclass
class InputMaxima:
    """max |input| per channel of each smoothed projection, one tensor per layer."""

    qkv: list[torch.Tensor] = field(default_factory=list)  # [hidden]
    gate_up: list[torch.Tensor] = field(default_factory=list)  # [hidden]
    down: list[torch.Tensor] = field(default_factory=list)  # [intermediate]
    head: torch.Tensor | None = None  # [hidden]: the final norm's output, the LM head's input


class _Recorder:
    """Wraps a float linear: records max |x| per input channel, then runs it unchanged."""

    def __init__(self, linear, into: list[torch.Tensor]) -> None:
        self.linear = linear
        self.into = into

    def _record(self, x: torch.Tensor) -> None:
        self.into.append(x.float().abs().amax(dim=0))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        self._record(x)
        return self.linear(x, residual=residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        self._record(x)
        return self.linear.silu_mul(x)


def calibration_token_ids(tokenizer, max_tokens: int) -> list[int]:
    return tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))[:max_tokens]


@torch.inference_mode()
def measure_input_maxima(model, token_ids: list[int], block_size: int = 16) -> InputMaxima:
    """One prefill of `token_ids` through a float LlamaModel, recording each projection's input range."""
    maxima = InputMaxima()
    originals = []
    for layer in model.layers:
        originals.append((layer.qkv, layer.gate_up, layer.down))
        layer.qkv = _Recorder(layer.qkv, maxima.qkv)
        layer.gate_up = _Recorder(layer.gate_up, maxima.gate_up)
        layer.down = _Recorder(layer.down, maxima.down)
    try:
        maxima.head = prefill(model, token_ids, block_size).float().abs().amax(dim=0)
    finally:
        for layer, (qkv, gate_up, down) in zip(model.layers, originals, strict=True):
            layer.qkv, layer.gate_up, layer.down = qkv, gate_up, down
    return maxima


@torch.inference_mode()
def prefill(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Run one sequence through `model` in a throwaway KV cache: hidden states [n, hidden]."""
    config: ModelConfig = model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = KVCache(config, num_blocks, block_size, model.dtype, model.device)

    def i32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=model.device)

    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=model.device),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefill_block_tables=i32([list(range(num_blocks))]),
        prefill_query_start_loc=i32([0, n]),
        prefill_seq_lens=i32([n]),
    )
    ids = torch.tensor(token_ids, device=model.device)
    return model.forward(ids, torch.arange(n, device=model.device), meta, cache)


def smoothing_scales(input_max: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [in_features] for input maxima [in] and weight [out, in]."""
    weight_max = weight.float().abs().amax(dim=0).clamp(min=MIN_SCALE)
    scales = input_max.float().clamp(min=MIN_SCALE).pow(alpha) / weight_max.pow(1 - alpha)
    return scales.clamp(min=MIN_SCALE)


def smooth_tensors(
    config: ModelConfig, tensors: dict[str, torch.Tensor], maxima: InputMaxima
) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint's tensors with every layer's qkv, gate_up and down inputs smoothed."""
    out = dict(tensors)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        mlp_in = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        # qkv and gate_up inputs: fold 1 / s into the RMSNorm weight that produces them
        for norm, names, input_max in (
            (p + "input_layernorm.weight", attn, maxima.qkv[i]),
            (p + "post_attention_layernorm.weight", mlp_in, maxima.gate_up[i]),
        ):
            s = smoothing_scales(input_max, torch.cat([tensors[n] for n in names]))
            out[norm] = (tensors[norm].float() / s).to(tensors[norm].dtype)
            for name in names:
                out[name] = (tensors[name].float() * s).to(tensors[name].dtype)
        # down's input is silu(gate) * up: fold 1 / s into the up rows
        down, up = p + "mlp.down_proj.weight", p + "mlp.up_proj.weight"
        s = smoothing_scales(maxima.down[i], tensors[down])
        out[up] = (out[up].float() / s[:, None]).to(tensors[up].dtype)
        out[down] = (tensors[down].float() * s).to(tensors[down].dtype)
    # the LM head's input: fold 1 / s into the final norm; a tied head gets its own scaled copy
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    s = smoothing_scales(maxima.head, head)
    out["model.norm.weight"] = (tensors["model.norm.weight"].float() / s).to(tensors["model.norm.weight"].dtype)
    out["lm_head.weight"] = (head.float() * s).to(head.dtype)
    return out
