"""Random-weight models of real shapes (worker/bench/random_model.py) and the bench's decode breakdown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.bench.random_model import FAMILIES, build_random_model, hf_config, random_model_path
from worker.commands import bench
from worker.engine.config import ModelConfig
from worker.engine.parameters import parameter_counts

# a tiny shape of any family: the real vocabulary (ids past the copied tokenizer's), two layers
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128}  # fmt: skip
TINY_MOE = TINY | {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}


def test_random_families_have_their_real_shapes() -> None:
    qwen3 = ModelConfig.from_hf(hf_config("qwen3-0.6b"))
    assert (qwen3.model_type, qwen3.hidden_size, qwen3.num_layers, qwen3.num_heads, qwen3.num_kv_heads) == (
        "qwen3", 1024, 28, 16, 8)  # fmt: skip
    assert (qwen3.head_dim, qwen3.intermediate_size, qwen3.vocab_size, qwen3.rope_theta) == (
        128,
        3072,
        151936,
        1e6,
    )
    assert qwen3.qk_norm and qwen3.tie_word_embeddings

    gemma = ModelConfig.from_hf(hf_config("gemma3-1b"))
    assert (gemma.model_type, gemma.hidden_size, gemma.num_layers, gemma.num_heads, gemma.num_kv_heads) == (
        "gemma3_text", 1152, 26, 4, 1)  # fmt: skip
    assert (gemma.head_dim, gemma.intermediate_size, gemma.vocab_size) == (256, 6912, 262144)
    assert gemma.layer_windows == tuple(
        0 if (i + 1) % 6 == 0 else 512 for i in range(26)
    )  # 5 local : 1 global
    assert (gemma.rope_theta, gemma.local_rope_theta, gemma.softmax_scale) == (1e6, 1e4, 256**-0.5)
    assert gemma.hidden_act == "gelu_tanh" and gemma.sandwich_norms and gemma.tie_word_embeddings

    llama = ModelConfig.from_hf(hf_config("llama3.2-1b"))
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (
        2048, 16, 32, 8, 64)  # fmt: skip
    assert (llama.intermediate_size, llama.vocab_size, llama.rope_theta) == (8192, 128256, 500000.0)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 32.0
    assert llama.tie_word_embeddings

    # the GPU stage's shape (scripts/gpu_e2e.py): Llama-3.1-8B's published 8,030,261,248 parameters
    assert parameter_counts(ModelConfig.from_hf(hf_config("llama3.1-8b"))).total == 8_030_261_248

    moe = ModelConfig.from_hf(hf_config("qwen3-moe-small"))
    assert (moe.model_type, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        "qwen3_moe", 64, 8, 256)  # fmt: skip
    assert moe.sparse_layers == (True,) * 12 and moe.norm_topk_prob and not moe.tie_word_embeddings


def test_unknown_random_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown random model 'nope'"):
        random_model_path("random:nope", tmp_path)
    assert set(FAMILIES) >= {"qwen3-0.6b", "gemma3-1b", "llama3.2-1b", "qwen3-moe-small"}


@pytest.mark.parametrize(("name", "overrides"), [("qwen3-0.6b", TINY), ("qwen3-moe-small", TINY_MOE)])
def test_tiny_random_model_runs_the_bench_with_a_breakdown(
    name: str, overrides: dict, models_cache_dir: Path, tmp_path: Path
) -> None:
    model_dir = build_random_model(name, tmp_path / name, models_cache_dir, overrides)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["vocab_size"] == 151936
    assert (model_dir / "tokenizer.json").is_file() and not (tmp_path / f"{name}.partial").exists()

    out = tmp_path / "bench.jsonl"
    argv = ["--n", "3", "--start", "0", "--output-len", "6", "--model", str(model_dir), "--systems", "freight-fp32",
            "--kv-cache-memory-gb", "0.05", "--breakdown", "--json-out", str(out)]  # fmt: skip
    assert bench(argv) == 0
    (freight,) = [
        r for r in map(json.loads, out.read_text().splitlines()) if r.get("system") == "freight-fp32"
    ]
    assert freight["output_tokens"] == 3 * 6  # garbage ids past the tokenizer's vocabulary decode fine
    breakdown = freight["decode_breakdown"]
    assert breakdown["decode_steps"] > 0 and breakdown["decode_seconds"] > 0
    shares = breakdown["shares"]
    assert all(shares[part] > 0 for part in ("attention", "mlp", "projections", "lm_head"))
    assert sum(shares[part] for part in ("attention", "mlp", "projections", "lm_head", "rest")) == pytest.approx(
        1.0, abs=1e-3
    )
    prefill = freight["prefill_breakdown"]
    assert prefill["prefill_steps"] > 0 and prefill["prefill_seconds"] > 0
    assert all(prefill["seconds"][part] > 0 for part in ("attention", "mlp", "projections"))
