"""Engine-side CLI commands, imported lazily by jobs/cli/admin.py (which must not import torch itself)."""

from __future__ import annotations

from pathlib import Path


def models_pull(alias: str, cache_dir: str | None = None) -> Path:
    """Fetch and convert a model alias (or convert a .gguf file) once; return its cached HF folder."""
    from worker.engine.loader import resolve_model_path

    return resolve_model_path(alias, Path(cache_dir) if cache_dir else None)


def bench(argv: list[str]) -> int:
    """`freight bench ...`: parses its own arguments; see worker/bench/run.py."""
    from worker.bench.run import main

    return main(argv)
