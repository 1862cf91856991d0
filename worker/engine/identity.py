"""What an engine's outputs depend on besides the request: the model's files and its numerics mode. A
result cache keys its entries with it (worker/shard/cache_key.py).

The mode is what changes the arithmetic by design: device and ISA tier, compute dtype, weight
quantization, KV cache dtype, smoothing, and whether products run in fixed row blocks (the
batch-invariant mode, docs/engine.md). Choices measured at load for speed (which INT8 GEMM, how many
rows the small-batch kernel takes, speculation) are left out: in the batch-invariant mode they do not
change a token, and outside it they change outputs no more than another batch composition does, while
a busy machine can measure them differently at each start and would make every start a cold cache."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class NumericsIdentity:
    model_revision: str  # digest of the model folder's file names, sizes and modification times
    device: str  # cpu | cuda
    tier: str  # the ISA tier (or cuda) the kernels were built for
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    smoothing: bool
    batch_invariant_rows: int  # > 0: the batch-invariant (exact) mode
    torch_version: str

    @property
    def batch_invariant(self) -> bool:
        return self.batch_invariant_rows > 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_revision(path: Path) -> str:
    """A cheap revision of a model folder: re-pulled, converted or edited files change it (contents are
    not hashed: reading gigabytes at every load would cost more than a rare needless cache miss)."""
    digest = hashlib.sha256()
    for item in sorted(path.iterdir()):
        if item.is_file():
            stat = item.stat()
            digest.update(f"{item.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def numerics_identity(
    *,
    model_path: Path,
    device: torch.device,
    tier: str,
    dtype: str,
    quantization: str | None,
    kv_dtype: torch.dtype,
    smoothing: bool,
    invariant_rows: int,
) -> NumericsIdentity:
    return NumericsIdentity(
        model_revision=model_revision(model_path),
        device=device.type,
        tier=tier,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        smoothing=smoothing and quantization == "int8",
        batch_invariant_rows=invariant_rows,
        torch_version=torch.__version__,
    )
