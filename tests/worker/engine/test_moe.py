"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers, on tiny random-weight models of the
family's own config class (tests/worker/engine/families.py): float32 greedy tokens identical to `generate`,
prefill logits close, INT8 close to float32; the grouped expert product against a per-token loop and
transformers' own block; both checkpoint layouts of the experts; active vs total parameters."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.worker.engine import test_families
from tests.worker.engine.families import BASE, FAMILIES, Family, build_family
from worker.engine import LLM
from worker.engine.config import ModelConfig
from worker.engine.loader import load_checkpoint
from worker.engine.model import DecoderModel
from worker.engine.moe import MoEBlock, naive_moe
from worker.engine.parameters import parameter_counts
from worker.engine.plan.smoothing import measure_input_maxima, prefill, smooth_tensors
from worker.engine.quantization import FloatLinear, make_linear
from worker.engine.weights import canonical_tensors, missing_tensor_names

# the two FAMILIES entries (also run by test_families), and Qwen3-MoE without renormalised top-k weights,
# sparse every second layer (decoder_sparse_step 2)
VARIANTS = {
    "qwen3_moe": FAMILIES["qwen3_moe"],
    "mixtral": FAMILIES["mixtral"],
    "qwen3_moe_unnormed": replace(FAMILIES["qwen3_moe"], name="qwen3_moe_unnormed", options=FAMILIES["qwen3_moe"].options
                                  | dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])),
}  # fmt: skip
INT8 = dict(dtype="float32", quantization="int8", kv_cache_dtype="int8")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_dir(request, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    name = request.param
    return build_family(VARIANTS[name], tmp_path_factory.mktemp(f"tiny_{name}") / name, smollm2_path)


def _family(model_dir: Path) -> Family:
    return VARIANTS[model_dir.name]


def test_config_marks_sparse_layers(moe_dir: Path) -> None:
    config = load_checkpoint(str(moe_dir)).config
    want = {"qwen3_moe": (True, True, False, True), "mixtral": (True,) * 4,
            "qwen3_moe_unnormed": (False, True, False, True)}[moe_dir.name]  # fmt: skip
    assert config.sparse_layers == want
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.norm_topk_prob == (moe_dir.name != "qwen3_moe_unnormed")
    assert config.moe_intermediate_size == (96 if moe_dir.name == "mixtral" else 48)
    assert config.qk_norm == moe_dir.name.startswith("qwen3")
    assert config.layer_windows == ((24,) * 4 if moe_dir.name == "mixtral" else (0,) * 4)


def test_unnormed_float32_greedy_tokens_match_transformers(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_families runs the two FAMILIES entries; this is the variant it lacks."""
    family = VARIANTS["qwen3_moe_unnormed"]
    model_dir = build_family(family, tmp_path / family.name, smollm2_path)
    monkeypatch.setitem(test_families.FAMILIES, family.name, family)
    test_families.test_float32_greedy_tokens_match_transformers(model_dir)


def test_prefill_logits_match_transformers(moe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(test_families.FAMILIES, moe_dir.name, _family(moe_dir))
    test_families.test_prefill_logits_match_transformers(moe_dir)


def test_int8_runs_and_agrees_with_float32(moe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """INT8 weights and KV (smoothing on) generate end to end. Against float32: top-k routing is where INT8
    error grows in these random-router models (a token whose top-2 flips gets another expert's output:
    10-30% of tokens by the last layer, measured), so the per-expert INT8 products are checked with the
    routing pinned to float32's, where the logits must agree as a dense model's do; unpinned, loosely."""
    prompts = test_families.family_prompts()
    exact = test_families.greedy(
        LLM(str(moe_dir), **test_families.EXACT, enable_speculation=False), prompts, 8
    )
    int8 = test_families.greedy(
        LLM(str(moe_dir), **(test_families.EXACT | INT8), enable_speculation=False), prompts, 8
    )
    assert [len(t) for t in int8] == [8] * len(prompts)
    assert sum(a == b for g, w in zip(int8, exact, strict=True) for a, b in zip(g, w, strict=True)) > 0

    checkpoint = load_checkpoint(str(moe_dir))
    config, tensors = checkpoint.config, canonical_tensors(checkpoint.config, checkpoint.tensors)
    cpu, prompt = torch.device("cpu"), prompts[-1]
    routes: list[tuple[torch.Tensor, torch.Tensor]] = []
    route = MoEBlock.route
    monkeypatch.setattr(MoEBlock, "route", lambda self, x: routes.append(route(self, x)) or routes[-1])
    float_model = DecoderModel(config, tensors, torch.float32, None, cpu, max_positions=256)
    want = float_model.logits(prefill(float_model, prompt))
    int8_model = DecoderModel(config, tensors, torch.float32, "int8", cpu, max_positions=256)
    pinned = iter(routes)
    monkeypatch.setattr(MoEBlock, "route", lambda self, x: next(pinned))
    got_pinned = int8_model.logits(prefill(int8_model, prompt))
    monkeypatch.setattr(MoEBlock, "route", route)
    got = int8_model.logits(prefill(int8_model, prompt))

    def relative_error(logits: torch.Tensor) -> float:
        return ((logits - want).norm() / want.norm()).item()

    assert relative_error(got_pinned) < 0.15  # measured 0.04 (Qwen3-MoE), 0.09 (Mixtral)
    assert (got_pinned.argmax(-1) == want.argmax(-1)).float().mean() >= 0.7
    assert relative_error(got) < 0.6  # measured 0.17, 0.38


def _random_block(experts: int, hidden: int, inter: int, gen: torch.Generator):
    router = torch.randn(experts, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return router, gate_up, down


@pytest.mark.parametrize("top_k,norm", [(2, True), (2, False), (3, True), (1, False)])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_grouped_experts_match_per_token_loop(top_k: int, norm: bool, quantization: str | None) -> None:
    gen = torch.Generator().manual_seed(top_k)
    router, gate_up, down = _random_block(8, 64, 40, gen)
    block = MoEBlock(
        FloatLinear(router, None, torch.float32, torch.float32),
        [make_linear(w, None, torch.float32, quantization) for w in gate_up],
        [make_linear(w, None, torch.float32, quantization) for w in down], top_k, norm,
    )  # fmt: skip
    for tokens in (1, 3, 37):
        x = torch.randn(tokens, 64, generator=gen)
        want = naive_moe(x, router, gate_up, down, top_k, norm)
        got = block(x)
        tol = 1e-5 if quantization is None else 5e-2
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
        residual = torch.randn(tokens, 64, generator=gen)
        torch.testing.assert_close(block(x, residual=residual), residual + got)
    assert block(torch.zeros(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_block_matches_transformers_block(family: str) -> None:
    """The same routing as transformers' block, and float32 outputs equal up to GEMM rounding (transformers'
    eager and grouped_mm paths order an expert's rows differently, which moves the last bit of a few)."""
    options = BASE | FAMILIES[family].options | dict(norm_topk_prob=family == "qwen3_moe")
    hf_config = FAMILIES[family].config_class(**options)
    hf_block = (Qwen3MoeSparseMoeBlock if family == "qwen3_moe" else MixtralSparseMoeBlock)(hf_config).eval()
    gen = torch.Generator().manual_seed(3)
    router, gate_up, down = _random_block(8, 64, hf_block.experts.down_proj.shape[-1], gen)
    with torch.no_grad():
        hf_block.gate.weight.copy_(router)
        hf_block.experts.gate_up_proj.copy_(gate_up)
        hf_block.experts.down_proj.copy_(down)
    config = ModelConfig.from_hf(hf_config)
    block = MoEBlock(
        FloatLinear(router, None, torch.float32, torch.float32),
        [make_linear(w, None, torch.float32, None) for w in gate_up],
        [make_linear(w, None, torch.float32, None) for w in down], config.num_experts_per_tok, config.norm_topk_prob,
    )  # fmt: skip
    x = torch.randn(1, 50, 64, generator=gen)
    with torch.no_grad():
        want = hf_block(x)[0]
        _, hf_weights, hf_experts = hf_block.gate(x[0])
    weights, experts = block.route(x[0])
    assert torch.equal(experts, hf_experts.sort(dim=-1).values)
    assert torch.equal(weights.sort(dim=-1).values, hf_weights.float().sort(dim=-1).values)
    torch.testing.assert_close(block(x[0]), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def _per_expert_to_fused(src: Path, dst: Path, block: str) -> None:
    """Copy a saved (per-expert, hub-layout) model folder with its experts in transformers 5's fused layout."""
    shutil.copytree(src, dst)
    (weights_file,) = dst.glob("*.safetensors")
    tensors = load_file(weights_file)
    config = json.loads((dst / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    gate, up, down = (
        ("w1", "w3", "w2") if block == "block_sparse_moe." else ("gate_proj", "up_proj", "down_proj")
    )
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.{block}"
        if p + "gate.weight" not in tensors:
            continue
        pieces = {
            n: [tensors.pop(f"{p}experts.{e}.{n}.weight") for e in range(experts)] for n in (gate, up, down)
        }
        q = f"model.layers.{layer}.mlp."  # transformers 5's in-memory names (Mixtral: block_sparse_moe -> mlp)
        tensors[q + "gate.weight"] = tensors.pop(p + "gate.weight")
        tensors[q + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(pieces[gate], pieces[up], strict=True)]
        )
        tensors[q + "experts.down_proj"] = torch.stack(pieces[down])
    save_file(tensors, weights_file, metadata={"format": "pt"})


def test_both_expert_layouts_load_alike(moe_dir: Path, tmp_path: Path) -> None:
    hub = load_checkpoint(str(moe_dir))
    block = "block_sparse_moe." if moe_dir.name == "mixtral" else "mlp."
    assert any(f".{block}experts.0." in name for name in hub.tensors), (
        "save_pretrained writes per-expert tensors"
    )
    _per_expert_to_fused(moe_dir, tmp_path / "fused", block)
    fused = load_checkpoint(str(tmp_path / "fused"))
    assert any(name.endswith("experts.gate_up_proj") for name in fused.tensors)
    for checkpoint in (hub, fused):
        assert missing_tensor_names(checkpoint.config, checkpoint.tensors) == []
    want, got = canonical_tensors(hub.config, hub.tensors), canonical_tensors(fused.config, fused.tensors)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    sparse = [i for i in range(4) if hub.config.is_sparse(i)]
    assert got[f"layers.{sparse[0]}.experts.gate_up"].shape == (8, 2 * hub.config.moe_intermediate_size, 64)
    # a missing expert tensor is named
    name = next(n for n in hub.tensors if f"{block}experts.3." in n)
    tensors = {k: v for k, v in hub.tensors.items() if k != name}
    assert missing_tensor_names(hub.config, tensors) == [name]


def test_active_parameters_count_top_k_experts(moe_dir: Path) -> None:
    config = load_checkpoint(str(moe_dir)).config
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    counts = parameter_counts(config)
    assert counts.total == sum(p.numel() for p in hf.parameters())
    sparse = sum(config.is_sparse(i) for i in range(config.num_layers))
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    assert (
        counts.total - counts.active
        == sparse * (config.num_experts - config.num_experts_per_tok) * expert
    )
    dense = replace(config, num_experts=0, sparse_layers=())
    assert parameter_counts(dense).total == parameter_counts(dense).active


def test_qwen3_moe_config_without_experts_is_dense() -> None:
    config = ModelConfig.from_hf(Qwen3MoeConfig(**BASE, num_experts=0))
    assert not any(config.is_sparse(i) for i in range(config.num_layers))


def test_smoothing_keeps_float_outputs(moe_dir: Path) -> None:
    """Smoothing moves ranges between activations and weights: in float32 the logits barely move, the
    routing included (the router's columns are scaled with the norm's)."""
    checkpoint = load_checkpoint(str(moe_dir))
    config, tensors = checkpoint.config, canonical_tensors(checkpoint.config, checkpoint.tensors)
    cpu = torch.device("cpu")
    model = DecoderModel(config, tensors, torch.float32, None, cpu, max_positions=256)
    prompt = test_families.family_prompts()[-1]
    maxima = measure_input_maxima(model, prompt)
    sparse = [i for i in range(config.num_layers) if config.is_sparse(i)]
    assert {layer for layer, _ in maxima.expert_down} == set(sparse)
    smoothed = smooth_tensors(config, tensors, maxima)
    assert not torch.equal(
        smoothed[f"layers.{sparse[0]}.experts.down"], tensors[f"layers.{sparse[0]}.experts.down"]
    )
    want = model.logits(prefill(model, prompt))
    smoothed_model = DecoderModel(config, smoothed, torch.float32, None, cpu, max_positions=256)
    got = smoothed_model.logits(prefill(smoothed_model, prompt))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
