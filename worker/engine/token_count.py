"""The exact prompt tokens of the API's quote, answered by `freight-grammar-check` (grammar_check.py), the
API's one child that may load engine code: the API never imports torch or transformers.

In:  {"count_tokens": {"model": alias or folder, "models_dir": the model cache, "context_len": tokens,
      "truncate": bool, "prompts": [[prompt (text or chat messages), the row's max_tokens], ...]}}
Out: {"tokens": [ids of each prompt as the engine runs it, or null: not run (too long)]} or {"error": why}

Each prompt is tokenized by prompt_ids.py, the worker's own rule, with the model's own tokenizer. The model
is looked up where the workers keep it and never pulled or converted here: a model this host does not
hold gets an error, and the quote falls back to its estimate."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.engine.loader import KNOWN_MODELS
from worker.engine.prompt_ids import prompt_token_ids, runnable, truncate_budget

TOKENIZERS_KEPT = 4  # one per model the API quotes for; a few models at most


def model_folder(model: str, models_dir: Path) -> Path | None:
    """The HF folder of `model` when this host already holds it (an alias pulled into the cache, or a
    folder); None otherwise (not pulled yet, a .gguf file not converted yet)."""
    folder = models_dir / model if model in KNOWN_MODELS else Path(model).expanduser()
    return folder if (folder / "config.json").is_file() else None


@dataclass
class Tokenizers:
    """The tokenizers loaded so far, by folder: loading one takes about a second."""

    loaded: OrderedDict[Path, Any] = field(default_factory=OrderedDict)

    def of(self, folder: Path) -> Any:
        if folder not in self.loaded:
            from transformers import AutoTokenizer  # as loader.load_checkpoint loads the engine's

            self.loaded[folder] = AutoTokenizer.from_pretrained(folder)
            while len(self.loaded) > TOKENIZERS_KEPT:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(folder)
        return self.loaded[folder]


def count_tokens(request: dict, tokenizers: Tokenizers) -> dict:
    """The answer to one count request (the module's docstring)."""
    try:
        model, context_len = str(request["model"]), int(request["context_len"])
        folder = model_folder(model, Path(request["models_dir"]))
        if folder is None:
            return {"error": f"model {model!r} is not on this host"}
        prompts = [prompt for prompt, _max_tokens in request["prompts"]]
        budgets = [
            truncate_budget(context_len, int(max_tokens)) if request.get("truncate") else None
            for _prompt, max_tokens in request["prompts"]
        ]
        encoded = prompt_token_ids(tokenizers.of(folder), prompts, max_model_len=context_len, budgets=budgets)
    except Exception as exc:  # a malformed request, a tokenizer that will not load, no chat template
        return {"error": f"{exc.__class__.__name__}: {exc}"}
    return {"tokens": [len(ids) if runnable(ids, context_len) else None for ids in encoded]}
