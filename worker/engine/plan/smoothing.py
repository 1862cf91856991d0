"""SmoothQuant-style smoothing before INT8 quantization, calibrated at load time on a shipped text.

Per-token INT8 activations lose the small values of a token when a few channels carry huge ones (the
input of down_proj reaches thousands in SmolLM2 while most entries are below ten), since one scale per
token must cover its largest entry. Smoothing divides input channel j by s_j and multiplies the weight's
column j by s_j, which leaves the product unchanged in exact arithmetic but moves the outliers' range
into the weights, where per-output-channel scales absorb it:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

The 1 / s_j is folded into what produces the input, so no extra op runs: the RMSNorm weight before
qkv and gate_up, the up rows of gate_up before down (act(gate) * up is linear in up), and the final
norm before the LM head (a tied head then gets a scaled copy of the embeddings). max|X_j|
comes from one float forward pass over worker/engine/calibration.txt; nothing is downloaded.

Mixture-of-experts layers (moe.py): one s for the block input, from its maxima and the concatenated
experts' gate_up weights, folded into the norm before the block (the float32 router reads the same
input: its columns are scaled by s too, so the routing is unchanged in exact arithmetic); each expert's
down input is smoothed on its own, folded into that expert's up rows, where calibration routed tokens
to it (an expert that got none keeps s = 1: there is no range to move).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.engine.attention import AttentionMetadata, KVCache
from worker.engine.config import ModelConfig
from worker.engine.model import DecoderModel

CALIBRATION_TEXT = Path(__file__).parent.parent / "calibration.txt"  # shipped beside the engine
CALIBRATION_TOKENS = 512  # tokens of the shipped text run through the float model to calibrate smoothing
ALPHA = 0.5  # SmoothQuant's default migration strength
MIN_SCALE = 1e-5  # keeps s_j finite for channels that never fire


@dataclass
class InputMaxima:
    """max |input| per channel of each smoothed projection, one tensor per layer."""

    qkv: list[torch.Tensor] = field(default_factory=list)  # [hidden]
    gate_up: list[torch.Tensor] = field(default_factory=list)  # [hidden]
    down: list[torch.Tensor] = field(default_factory=list)  # [intermediate]
    head: torch.Tensor | None = None  # [hidden]: the final norm's output, the LM head's input
    # sparse layers: gate_up[i] is the MoE block's input, down[i] is empty; per (layer, expert) that got
    # calibration tokens, its down input [moe_intermediate]
    expert_down: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


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

    def gated_mul(self, x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        self._record(x)
        return self.linear.gated_mul(x, activation)

    def normed(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.linear.normed(hidden, weight, eps)  # a float linear's: the normalized rows themselves


def calibration_token_ids(tokenizer, max_tokens: int) -> list[int]:
    return tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))[:max_tokens]


class _MoERecorder:
    """Wraps an MoE block: records max |x| of its input, and (through each expert's down) of each expert's
    down input."""

    def __init__(self, block, maxima: InputMaxima, layer: int) -> None:
        self.block = block
        self.maxima = maxima
        self.layer = layer

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        self.maxima.gate_up.append(x.float().abs().amax(dim=0))
        self.maxima.down.append(x.new_zeros(0))  # keeps maxima.down indexed by layer
        downs = self.block.down
        recorded: list[list[torch.Tensor]] = [[] for _ in downs]
        self.block.down = [_Recorder(d, into) for d, into in zip(downs, recorded, strict=True)]
        try:
            out = self.block(x, residual=residual)
        finally:
            self.block.down = downs
        for expert, into in enumerate(recorded):
            if into:
                self.maxima.expert_down[(self.layer, expert)] = torch.stack(into).amax(dim=0)
        return out


@torch.inference_mode()
def measure_input_maxima(model, token_ids: list[int], block_size: int = 16) -> InputMaxima:
    """One prefill of `token_ids` through a float DecoderModel, recording each projection's input range."""
    maxima = InputMaxima()
    originals = []
    for i, layer in enumerate(model.layers):
        moe = getattr(layer, "moe", None)
        originals.append((layer.qkv, layer.gate_up, layer.down, moe))
        layer.qkv = _Recorder(layer.qkv, maxima.qkv)
        if moe is not None:
            layer.moe = _MoERecorder(moe, maxima, i)
        else:
            layer.gate_up = _Recorder(layer.gate_up, maxima.gate_up)
            layer.down = _Recorder(layer.down, maxima.down)
    try:
        maxima.head = prefill(model, token_ids, block_size).float().abs().amax(dim=0)
    finally:
        for layer, (qkv, gate_up, down, moe) in zip(model.layers, originals, strict=True):
            layer.qkv, layer.gate_up, layer.down = qkv, gate_up, down
            if moe is not None:
                layer.moe = moe
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
    """A copy of the canonical tensors (weights.py) with every layer's qkv, gate_up and down inputs smoothed."""
    out = dict(tensors)

    def fold(norm: str, weight: str, input_max: torch.Tensor) -> None:
        """Input channels of `weight` scaled by s, the RMSNorm weight that produces its input by 1 / s."""
        s = smoothing_scales(input_max, tensors[weight])
        out[norm] = (tensors[norm].float() / s).to(tensors[norm].dtype)
        out[weight] = (tensors[weight].float() * s).to(tensors[weight].dtype)

    for i in range(config.num_layers):
        p = f"layers.{i}."
        fold(p + "attn_norm", p + "qkv", maxima.qkv[i])
        if config.is_sparse(i):
            _smooth_moe(config, tensors, out, maxima, i)
            continue
        fold(p + "mlp_norm", p + "gate_up", maxima.gate_up[i])
        # down's input is act(gate) * up, linear in up: fold 1 / s into the up rows (the second half)
        down, gate_up = p + "down", p + "gate_up"
        s = smoothing_scales(maxima.down[i], tensors[down])
        half = config.intermediate_size
        up = out[gate_up].float()
        out[gate_up] = torch.cat([up[:half], up[half:] / s[:, None]]).to(tensors[gate_up].dtype)
        out[down] = (tensors[down].float() * s).to(tensors[down].dtype)
    # the LM head's input: fold 1 / s into the final norm; a tied head gets its own scaled copy
    head = tensors.get("lm_head", tensors["embed"])
    s = smoothing_scales(maxima.head, head)
    out["norm"] = (tensors["norm"].float() / s).to(tensors["norm"].dtype)
    out["lm_head"] = (head.float() * s).to(head.dtype)
    return out


def _smooth_moe(
    config: ModelConfig, tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor], maxima: InputMaxima, i: int
) -> None:
    """A sparse layer: the block input (norm, router, every expert's gate_up) and each expert's down input."""
    p = f"layers.{i}."
    norm, router, gate_up, down = p + "mlp_norm", p + "router", p + "experts.gate_up", p + "experts.down"
    hidden = config.hidden_size
    s = smoothing_scales(maxima.gate_up[i], tensors[gate_up].reshape(-1, hidden))
    out[norm] = (tensors[norm].float() / s).to(tensors[norm].dtype)
    out[router] = (tensors[router].float() * s).to(tensors[router].dtype)
    experts_gate_up = tensors[gate_up].float() * s
    experts_down = tensors[down].float().clone()
    half = config.moe_intermediate_size
    for expert in range(config.num_experts):
        input_max = maxima.expert_down.get((i, expert))
        if input_max is None:
            continue
        s_e = smoothing_scales(input_max, experts_down[expert])
        experts_gate_up[expert, half:] /= s_e[:, None]
        experts_down[expert] *= s_e
    out[gate_up] = experts_gate_up.to(tensors[gate_up].dtype)
    out[down] = experts_down.to(tensors[down].dtype)


def smoothed(
    config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer, dtype: torch.dtype, device: torch.device,
    max_positions: int, block_size: int,
) -> dict[str, torch.Tensor]:
    """The canonical tensors smoothed: calibrated on the shipped text with the float model, which is then
    dropped (the engine's load step, before the INT8 model is built)."""
    float_model = DecoderModel(config, tensors, dtype, None, device, max_positions=max_positions)
    ids = calibration_token_ids(tokenizer, min(CALIBRATION_TOKENS, max_positions))
    maxima = measure_input_maxima(float_model, ids, block_size)
    del float_model
    return smooth_tensors(config, tensors, maxima)
