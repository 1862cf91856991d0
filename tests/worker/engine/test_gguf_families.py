"""Every family as users have it, through Freight's one loader: a GGUF file in llama.cpp's conventions (F32
and Q8_0, gguf_writer.py) and an HF folder sharded with an index file. Converted tensors exactly those the
file encodes, the engine's config that of the original model, and float32 greedy tokens identical to
transformers' `generate` on the model the file holds."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker.engine.gguf_writer import F32, GGUF_VARIANTS, Q8_0, build_gguf_family, write_gguf
from tests.worker.engine.test_families import EXACT, family_prompts, greedy, hf_greedy
from worker.engine import LLM
from worker.engine.config import ModelConfig
from worker.engine.gguf_convert import GGUF_FIXUPS
from worker.engine.loader import load_checkpoint, load_config

NEW_TOKENS = 64
PLAIN = EXACT | dict(enable_prefix_caching=False, enable_speculation=False)


def prompts() -> list[list[int]]:
    """Three of test_families' prompts: 9 tokens, and 30 and 100 (past the 24-token window)."""
    every = family_prompts()
    return [every[0], every[1], every[5]]


@dataclass(frozen=True)
class Case:
    name: str
    hf_dir: Path  # the original model as an HF folder
    work: Path
    state_dict: dict[str, torch.Tensor]  # the original model's, as transformers holds it in memory
    want: list[list[int]]  # transformers' greedy tokens on the original model


@pytest.fixture(scope="module", params=sorted(GGUF_VARIANTS))
def case(request, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Case:
    name = request.param
    work = tmp_path_factory.mktemp(f"gguf_{name}")
    hf_dir = build_gguf_family(name, work / name, smollm2_path)
    state_dict = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    return Case(name, hf_dir, work, state_dict, hf_greedy(hf_dir, prompts(), NEW_TOKENS))


def engine_view(config: ModelConfig) -> dict[str, Any]:
    """The engine's config, as far as a GGUF can carry it: llama.cpp writes Mistral as the llama
    architecture (which the engine runs alike), and rope factors as float32."""
    fields = dataclasses.asdict(config)
    fields["model_type"] = {"mistral": "llama"}.get(fields["model_type"], fields["model_type"])
    fields["rope_scaling"] = _float32(fields["rope_scaling"])
    return fields


def _float32(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_float32(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tied: bool) -> None:
    want = {k: v for k, v in want.items() if not (tied and k == "lm_head.weight")}
    assert sorted(got) == sorted(want)
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"


def freight_tokens(model: Path, cache: Path) -> list[list[int]]:
    return greedy(LLM(str(model), cache_dir=str(cache), **PLAIN), prompts(), NEW_TOKENS)


def load_gguf(case: Case, qtype: gguf.GGMLQuantizationType) -> tuple[Path, dict[str, torch.Tensor], Any]:
    """Write the family's GGUF, load it through the loader (converting into a cache): (cache, the tensors
    the file encodes, the checkpoint)."""
    path, cache = case.work / f"{case.name}-{qtype.name}.gguf", case.work / f"cache-{qtype.name}"
    encoded = write_gguf(case.hf_dir, path, qtype)
    return cache, encoded, load_checkpoint(str(path), cache)


def test_f32_gguf_is_the_original_model(case: Case) -> None:
    cache, _, checkpoint = load_gguf(case, F32)
    assert_tensors_equal(checkpoint.tensors, case.state_dict, checkpoint.config.tie_word_embeddings)
    assert engine_view(checkpoint.config) == engine_view(load_config(str(case.hf_dir)))
    assert freight_tokens(case.work / f"{case.name}-F32.gguf", cache) == case.want


# Q8_0 and sharding do not depend on the architecture's fixups, only on how tensors are laid out: a Q8_0 file
# on the families whose tensors the reader rearranges (llama's q/k rows, stacked experts, Gemma's 1 + w norms,
# Phi-3's fused projections), a sharded folder on a dense and an expert model (CI time: every family was 5 min)
Q8_0_FAMILIES = ("gemma3", "llama3", "mixtral", "phi3", "qwen3_moe")
SHARDED_FAMILIES = ("llama3", "qwen3_moe")


@pytest.mark.parametrize("case", Q8_0_FAMILIES, indirect=True)
def test_q8_0_gguf_is_its_dequantized_weights(case: Case) -> None:
    cache, encoded, checkpoint = load_gguf(case, Q8_0)
    quantized = [k for k in encoded if not torch.equal(encoded[k], case.state_dict[k])]
    assert quantized, "Q8_0 should have changed the projections"
    assert_tensors_equal(checkpoint.tensors, encoded, checkpoint.config.tie_word_embeddings)
    assert engine_view(checkpoint.config) == engine_view(load_config(str(case.hf_dir)))
    # transformers' generate on the original architecture holding the file's (rounded) weights
    reference = AutoModelForCausalLM.from_pretrained(case.hf_dir, dtype=torch.float32)
    reference.load_state_dict(encoded, strict=False)  # a tied lm_head follows the embedding
    reference.save_pretrained(case.work / "q8_reference")
    want = hf_greedy(case.work / "q8_reference", prompts(), NEW_TOKENS)
    assert freight_tokens(case.work / f"{case.name}-Q8_0.gguf", cache) == want


@pytest.mark.parametrize("case", SHARDED_FAMILIES, indirect=True)
def test_sharded_folder_is_the_single_file(case: Case) -> None:
    sharded = case.work / "sharded"
    AutoModelForCausalLM.from_pretrained(case.hf_dir, dtype=torch.float32).save_pretrained(sharded, max_shard_size="1MB")
    AutoTokenizer.from_pretrained(case.hf_dir).save_pretrained(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, split = load_checkpoint(str(case.hf_dir)), load_checkpoint(str(sharded))
    assert_tensors_equal(split.tensors, single.tensors, tied=False)
    assert split.config == single.config
    assert freight_tokens(sharded, case.work / "cache-sharded") == case.want


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path: Path) -> None:
    """Refused before transformers reads it, naming what is read; nothing is left in the cache."""
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'") as error:
        load_checkpoint(str(path), cache)
    assert ", ".join(GGUF_FIXUPS) in str(error.value)
    assert not any((cache / "gguf").iterdir())
