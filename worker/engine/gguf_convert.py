"""Turn a GGUF file into a plain HF folder (float32 safetensors, config, tokenizer).

transformers dequantizes GGUF tensors on load (and undoes llama.cpp's q/k row permutation), so
we let it do the reading and write the state dict back out as ordinary safetensors. The folder
then loads like any HF checkpoint, without GGUF code on the hot path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write `out_dir` (which must not exist yet or be empty) from the GGUF file at `gguf_path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    folder, file_name = str(gguf_path.parent), gguf_path.name

    with _one_parse_per_file():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
        _write(gguf_path, out_dir, model, tokenizer)


@contextlib.contextmanager
def _one_parse_per_file() -> Iterator[None]:
    """transformers parses the whole GGUF file for the tokenizer, again for the config and again for the
    weights, and _fix_gemma3 reads it too: a Gemma 3 file's 262k vocabulary strings take ~30 s per parse on
    two cores. Within this block one reader per file serves every caller (transformers imports
    gguf.GGUFReader at call time, so it finds the shared one). The reader is read-only once built."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | Path, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _write(gguf_path: Path, out_dir: Path, model: Any, tokenizer: Any) -> None:
    """The folder: float32 safetensors, then config, generation config and tokenizer, fixed where needed."""
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
    if config.model_type == "gemma3_text":
        _fix_gemma3(gguf_path, config, model.generation_config, tokenizer)
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# Gemma 3's chat format, as in the chat template of Google's Gemma 3 tokenizers: `<start_of_turn>user`
# / `<start_of_turn>model` turns closed by `<end_of_turn>`, a system message folded into the first
# user turn, `<bos>` first.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's hard-coded base for gemma3's sliding-window layers


def _fix_gemma3(gguf_path: Path, config: Any, generation_config: Any, tokenizer: Any) -> None:
    """Put right what transformers' GGUF reader (5.x) leaves out or off for gemma3.

    Read correctly already, and checked against Google's config.json for Gemma 3 270M: hidden 640,
    18 layers, 4 heads, 1 KV head, head_dim 256 (attention.key_length), intermediate 2048, vocab
    262144, sliding_window 512, max_position_embeddings 32768, tied embeddings (no output.weight),
    rope_theta 1e6 for the global layers (rope.freq_base). The GGUF stores no key for these, whose
    transformers defaults are also what llama.cpp hard-codes for gemma3: 5 sliding layers to 1
    global (layer_types), query_pre_attn_scalar 256 (= head_dim; only 27B differs), no logit
    softcapping. The norm weights, stored by llama.cpp as 1 + w, are shifted back on load.
    """
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields  # the shared reader (_one_parse_per_file)

    def scalar(key: str) -> Any:
        field = fields.get(key)
        if field is None:
            return None
        value = field.parts[field.data[0]]
        return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value[0].item()

    # 1. End of turn: llama.cpp writes one eos id (<eos>, 1), but a chat answer ends with
    # <end_of_turn> (106); Google's config.json and generation_config.json list both, [1, 106].
    # Without 106 a chat answer runs on into a made-up next turn (Freight's engine reads the eos ids
    # of config.json, transformers' generate those of generation_config.json).
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        eos = config.eos_token_id
        eos_ids = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        eos_ids += [end_of_turn] if end_of_turn not in eos_ids else []
        config.eos_token_id = eos_ids
        generation_config.eos_token_id = list(eos_ids)

    # 2. Chat template: a GGUF without tokenizer.chat_template (this one: converted from the
    # pretrained model) leaves the tokenizer with none; Gemma 3's is the format the family uses.
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE

    # 3. rms_norm_eps is a float32 in GGUF: 1e-6 comes back as 9.999999974752427e-07. Write the
    # shortest decimal of that float32 (1e-06, Google's value; the same number in float32).
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))

    # 4. RoPE: the reader maps gemma3.rope.freq_base to the global layers only. The sliding layers'
    # base has no GGUF key (llama.cpp hard-codes 10000); pin it rather than trust a default. The
    # global layers' linear scaling (gemma3.rope.scaling.*, 8x in 4B and up; absent or 1 in 270M
    # and 1B) is dropped by the reader.
    rope = config.rope_parameters
    rope["sliding_attention"] = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}
    factor = scalar("gemma3.rope.scaling.factor")
    if factor is not None and factor != 1.0:
        rope["full_attention"].update(rope_type=scalar("gemma3.rope.scaling.type") or "linear", factor=factor)
    config.rope_parameters = rope
