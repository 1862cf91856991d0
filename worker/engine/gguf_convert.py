"""Turn a GGUF file into a plain HF folder (float32 safetensors, config, tokenizer).

transformers dequantizes GGUF tensors on load (and undoes llama.cpp's q/k row permutation), so
we let it do the reading and write the state dict back out as ordinary safetensors. The folder
then loads like any HF checkpoint, without GGUF code on the hot path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write `out_dir` (which must not exist yet or be empty) from the GGUF file at `gguf_path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    folder, file_name = str(gguf_path.parent), gguf_path.name

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))

    # A tied lm_head shares storage with the embedding; safetensors refuses shared tensors, and
    # HF folders leave the tied copy out anyway.
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    # The GGUF loader records quantization_config={quant_method: gguf}; the saved tensors are plain
    # float32, so a reader must not take the GGUF path again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
