"""Smoothing before INT8 quantization: exact in float arithmetic, and it narrows the activation range."""

from __future__ import annotations

import pytest
import torch

from worker.engine.loader import load_checkpoint
from worker.engine.model import DecoderModel
from worker.engine.plan.smoothing import calibration_token_ids, measure_input_maxima, prefill, smooth_tensors
from worker.engine.weights import canonical_tensors


def float_model(checkpoint, tensors) -> DecoderModel:
    return DecoderModel(checkpoint.config, tensors, torch.float32, None, torch.device("cpu"), max_positions=512)


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_smoothing_leaves_the_float_model_unchanged(model_dir, request) -> None:
    checkpoint = load_checkpoint(str(request.getfixturevalue(model_dir)))
    ids = calibration_token_ids(checkpoint.tokenizer, 200)
    assert len(ids) == 200  # the shipped text is long enough
    tensors = canonical_tensors(checkpoint.config, checkpoint.tensors)
    original = float_model(checkpoint, tensors)
    maxima = measure_input_maxima(original, ids)
    assert len(maxima.down) == checkpoint.config.num_layers
    smoothed_tensors = smooth_tensors(checkpoint.config, tensors, maxima)
    assert any(not torch.equal(smoothed_tensors[k], tensors[k]) for k in tensors)
    probe = list(range(50, 130))
    want = original.logits(prefill(original, probe))
    smoothed = float_model(checkpoint, smoothed_tensors)
    got = smoothed.logits(prefill(smoothed, probe))  # the final norm's output is smoothed, the logits are not
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_smoothing_narrows_the_down_projection_input(smollm2_path) -> None:
    """SmolLM2's down_proj inputs have a few huge channels; after smoothing the largest channel is far closer
    to the typical one, which is what per-token INT8 scales need."""
    checkpoint = load_checkpoint(str(smollm2_path))
    ids = calibration_token_ids(checkpoint.tokenizer, 256)
    tensors = canonical_tensors(checkpoint.config, checkpoint.tensors)
    before = measure_input_maxima(float_model(checkpoint, tensors), ids)
    smoothed = float_model(checkpoint, smooth_tensors(checkpoint.config, tensors, before))
    after = measure_input_maxima(smoothed, ids)

    def spread(maxima: list[torch.Tensor]) -> float:  # largest channel over the median one, worst layer
        return max((m.max() / m.median()).item() for m in maxima)

    print(f"down_proj input spread: {spread(before.down):.0f}x before, {spread(after.down):.0f}x after")
    assert spread(after.down) < spread(before.down) / 4
