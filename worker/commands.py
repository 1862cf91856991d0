"""Engine-side CLI commands, imported lazily by jobs/cli/admin.py (which must not import torch itself)."""

from __future__ import annotations

from pathlib import Path


def models_pull(alias: str, cache_dir: str | None = None) -> Path:
    """Fetch and convert a model alias (or convert a .gguf file) once; return its cached HF folder."""
    from worker.engine.loader import resolve_model_path

    return resolve_model_path(alias, Path(cache_dir) if cache_dir else None)


def models_check(model: str, cache_dir: str | None = None) -> list[str]:
    """What the engine makes of a model (alias, HF folder or .gguf) from its config alone: its family and
    shape, windows, experts and parameters. Raises ValueError, naming the supported types, for a model the
    engine refuses."""
    from worker.engine.loader import load_config
    from worker.engine.parameters import parameter_counts

    config = load_config(model, Path(cache_dir) if cache_dir else None)
    counts = parameter_counts(config)
    windows = sorted({config.window(i) for i in range(config.num_layers)} - {0})
    window_layers = sum(config.window(i) > 0 for i in range(config.num_layers))
    lines = [
        f"model_type   {config.model_type}",
        f"shape        {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} heads "
        f"/ {config.num_kv_heads} KV heads of {config.head_dim}, vocabulary {config.vocab_size}",
        "attention    " + (f"{window_layers} of {config.num_layers} layers windowed ({', '.join(map(str, windows))} "
                            "tokens)" if windows else "full on every layer"),
        f"parameters   {counts.total:,} ({counts.active:,} active per token)",
        f"context      {config.max_position_embeddings:,} tokens (FREIGHT_MAX_MODEL_LEN caps it when set)",
    ]
    if config.num_experts:
        sparse = sum(config.is_sparse(i) for i in range(config.num_layers))
        lines.insert(3, f"experts      {config.num_experts}, top {config.num_experts_per_tok}, on {sparse} layers")
    return lines


def bench(argv: list[str]) -> int:
    """`freight bench ...`: parses its own arguments; see worker/bench/run.py."""
    from worker.bench.run import main

    return main(argv)
