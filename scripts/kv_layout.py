"""KV-cache bytes one sequence holds at N tokens: the windowed layout (window layers keep only their
window's blocks, worker/engine/block_manager.py) against the layout without windows (every layer keeps
every block), for models with sliding-window layers, INT8 and bfloat16 caches.

    .venv/bin/python scripts/kv_layout.py [--tokens 8192] [--block-size 16]

The held blocks come from the engine's own bookkeeping: a BlockManager per KV group (attention.kv_groups)
prefills the sequence in 512-token chunks, then frees what lies before its next query's window. Prints a
Markdown table. Nothing is downloaded: the shapes are the models' configs.
"""

from __future__ import annotations

import argparse

import torch

from worker.engine.attention import KVCache, kv_groups
from worker.engine.block_manager import BlockManager, blocks_for
from worker.engine.config import ModelConfig
from worker.engine.outputs import RequestTimings
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

CHUNK = 512  # prefill chunk of the simulated sequence


def shape(num_layers: int, kv_heads: int, head_dim: int, windows: tuple[int, ...]) -> ModelConfig:
    """A config with the KV shape of a model (the rest does not size the cache)."""
    return ModelConfig(
        vocab_size=1, hidden_size=1, intermediate_size=1, num_layers=num_layers, num_heads=kv_heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=131072, tie_word_embeddings=True, layer_windows=windows,
    )  # fmt: skip


def gemma3(num_layers: int, window: int) -> ModelConfig:
    """5 window layers for each global one (layer i is global when (i + 1) % 6 == 0), 1 KV head of 256."""
    return shape(num_layers, 1, 256, tuple(0 if (i + 1) % 6 == 0 else window for i in range(num_layers)))


MODELS = {
    "Gemma-3-1B (26 layers, W=512, 5:1)": gemma3(26, 512),
    "Gemma-3-270M (18 layers, W=512, 5:1)": gemma3(18, 512),
    "Mistral-7B-v0.1 (32 layers, W=4096)": shape(32, 8, 128, (4096,) * 32),
}
DTYPES = {"INT8": torch.int8, "bf16": torch.bfloat16}


def held_blocks(window: int, num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of `num_tokens` computed tokens holds in a group of `window` (0: full)."""
    blocks = BlockManager(blocks_for(num_tokens, block_size) + 1, block_size, window=window)
    seq = Sequence(0, 0, [1] * num_tokens, SamplingParams(), RequestTimings(queued=0.0))
    for start in range(0, num_tokens, CHUNK):
        blocks.allocate(seq, min(start + CHUNK, num_tokens))
        seq.num_computed_tokens = min(start + CHUNK, num_tokens)
    blocks.free_out_of_window(seq)
    return blocks.num_used


def sequence_bytes(model: ModelConfig, num_tokens: int, block_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(windowed, without windows) bytes of one sequence's KV at `num_tokens` tokens."""
    per_layer_block = KVCache.bytes_per_layer_block(model, block_size, dtype)
    windowed = sum(len(g.layers) * held_blocks(g.window, num_tokens, block_size) for g in kv_groups(model))
    full = model.num_layers * blocks_for(num_tokens, block_size)
    return windowed * per_layer_block, full * per_layer_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    mib = 2**20
    print(f"KV bytes per sequence at {args.tokens} tokens (block size {args.block_size}; INT8 with float16 scales)")
    print()
    print("| model | KV cache | no-window layout | windowed layout | saving |")
    print("|---|---|---:|---:|---:|")
    for name, model in MODELS.items():
        for label, dtype in DTYPES.items():
            windowed, full = sequence_bytes(model, args.tokens, args.block_size, dtype)
            print(f"| {name} | {label} | {full / mib:.1f} MiB | {windowed / mib:.1f} MiB | {full / windowed:.2f}x |")


if __name__ == "__main__":
    main()
