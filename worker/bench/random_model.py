"""Random-weight HF folders of real model shapes: throughput per model family without the weights.

Speed does not depend on the weights' values, so `freight bench --model random:qwen3-0.6b` measures a family
on a model of its real shape: the config below (written out from the hub's config.json of the model named
in each entry's comment), built with the family's transformers config class and `from_config` (random
init), saved in bfloat16 into `<models cache>/random-<name>`, with a tokenizer copied from a model we have
(the Gemma 3 one for Gemma, SmolLM2's for the others). Built once, then reused.

The outputs are garbage, and token ids past the copied tokenizer's vocabulary occur (Qwen's 151,936 ids
against SmolLM2's 49,152): the bench generates a fixed length with EOS ignored, and decoding such ids drops
them (fast tokenizers skip unknown ids). Prompt-lookup speculation drafts from what the model repeats, and
a random model repeats differently from a trained one: read its acceptance (engine_stats) beside the rate.

    python -m worker.bench.random_model qwen3-0.6b [--cache-dir DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

PREFIX = "random:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")  # fmt: skip
SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma3-270m"


@dataclass(frozen=True)
class RandomFamily:
    config: Mapping[str, Any]  # config.json fields (model_type picks the transformers config class)
    tokenizer: str  # alias of the model whose tokenizer is copied (a folder in the models cache)
    source: str  # the hub model whose shape this is


def _layer_types(num_layers: int, local_per_global: int) -> list[str]:
    """Gemma 3's pattern: `local_per_global` sliding-window layers, then one global layer, repeated."""
    period = local_per_global + 1
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]


FAMILIES: Mapping[str, RandomFamily] = MappingProxyType({
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6b": RandomFamily(source="Qwen/Qwen3-0.6B", tokenizer=SMOLLM2, config={
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
    }),
    # Qwen/Qwen3-1.7B config.json
    "qwen3-1.7b": RandomFamily(source="Qwen/Qwen3-1.7B", tokenizer=SMOLLM2, config={
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
    }),
    # HuggingFaceTB/SmolLM2-360M-Instruct config.json
    "smollm2-360m": RandomFamily(source="HuggingFaceTB/SmolLM2-360M-Instruct", tokenizer=SMOLLM2, config={
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5,
        "head_dim": 64, "intermediate_size": 2560, "vocab_size": 49152, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": True,
    }),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct config.json
    "smollm2-1.7b": RandomFamily(source="HuggingFaceTB/SmolLM2-1.7B-Instruct", tokenizer=SMOLLM2, config={
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 64, "intermediate_size": 8192, "vocab_size": 49152, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 130000.0}, "tie_word_embeddings": True,
    }),
    # google/gemma-3-1b-it config.json (Gemma3ForCausalLM, text only)
    "gemma3-1b": RandomFamily(source="google/gemma-3-1b-it", tokenizer=GEMMA3, config={
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "layer_types": _layer_types(26, 5),
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True,
    }),
    # meta-llama/Llama-3.2-1B config.json
    "llama3.2-1b": RandomFamily(source="meta-llama/Llama-3.2-1B", tokenizer=SMOLLM2, config={
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    }),
    # meta-llama/Llama-3.1-8B config.json (the GPU stage's shape: scripts/gpu_e2e.py)
    "llama3.1-8b": RandomFamily(source="meta-llama/Llama-3.1-8B", tokenizer=SMOLLM2, config={
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False,
    }),
    # Qwen/Qwen3-30B-A3B config.json scaled down (hidden 2048 -> 1024, 48 -> 12 layers, 32 -> 16 heads,
    # 128 -> 64 experts, moe_intermediate 768 -> 256); kept: 4 KV heads, head_dim 128, top-8 routing with
    # renormalised weights, every layer sparse, vocab, rope, untied head
    "qwen3-moe-small": RandomFamily(source="Qwen/Qwen3-30B-A3B (scaled down)", tokenizer=SMOLLM2, config={
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 3072, "moe_intermediate_size": 256, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
    }),
})  # fmt: skip


def family(name: str) -> RandomFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def tokenizer_folder(alias: str, cache_dir: Path | None) -> Path:
    """The folder of the model whose tokenizer is copied: in the models cache (pulled there if missing)."""
    from worker.engine.loader import default_cache_dir, resolve_model_path

    for models in (cache_dir, default_cache_dir()):
        if models is not None and (Path(models) / alias / "tokenizer.json").is_file():
            return Path(models) / alias
    return resolve_model_path(alias, cache_dir)


def hf_config(name: str, overrides: Mapping[str, Any] | None = None, tokenizer_dir: Path | None = None):
    """The transformers config of a random model; special token ids follow the copied tokenizer."""
    from transformers import AutoConfig

    fields = dict(family(name).config) | dict(overrides or {})
    if tokenizer_dir is not None:
        tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if tokenizer_config.get(key) is not None:
                fields[key] = tokenizer_config[key]
    if "layer_types" in fields and len(fields["layer_types"]) != fields["num_hidden_layers"]:
        fields["layer_types"] = _layer_types(fields["num_hidden_layers"], 5)  # a layer count override
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def build_random_model(
    name: str,
    out_dir: Path,
    cache_dir: Path | None = None,
    overrides: Mapping[str, Any] | None = None,  # config fields to change (tests: a tiny shape)
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",  # where the random init runs: an 8B model's takes minutes on CPU, seconds on a GPU
) -> Path:
    """Write a random-weight HF folder of `name`'s shape (with `overrides`) into `out_dir`."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer_dir = tokenizer_folder(family(name).tokenizer, cache_dir)
    config = hf_config(name, overrides, tokenizer_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    scratch = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file() and not (scratch / file).exists():
            shutil.copy2(tokenizer_dir / file, scratch / file)
    shutil.rmtree(out_dir, ignore_errors=True)
    scratch.rename(out_dir)
    return out_dir


def random_model_path(spec: str, cache_dir: Path | str | None = None, force: bool = False) -> Path:
    """`random:<name>` -> `<models cache>/random-<name>`, built on first use."""
    from worker.engine.loader import default_cache_dir

    name = spec.removeprefix(PREFIX)
    family(name)
    models = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = models / f"random-{name}"
    if force or not (target / "config.json").is_file():
        models.mkdir(parents=True, exist_ok=True)
        build_random_model(name, target, Path(cache_dir) if cache_dir is not None else None)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=list(FAMILIES))
    parser.add_argument("--cache-dir", default=None, help="models cache (default $FREIGHT_HOME/models)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder exists")
    args = parser.parse_args(argv)
    print(random_model_path(args.name, args.cache_dir, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
