"""Turn a GGUF file into a plain HF folder (float32 safetensors, config, tokenizer).

transformers dequantizes GGUF tensors on load (and undoes llama.cpp's q/k row permutation and Gemma's
1 + w norms), so we let it do the reading and write the state dict back out as ordinary safetensors. The
folder then loads like any HF checkpoint, without GGUF code on the hot path.

transformers' reader maps only a few metadata keys per architecture: the rest of what llama.cpp's
convert_hf_to_gguf.py writes (an expert's intermediate size, Gemma 2's soft-capping, Phi-3's LongRoPE and
partial rotary, Llama 3's rope_freqs, ...) it drops, and a model built from its config alone would have
the wrong shape or compute something else. GGUF_FIXUPS, one entry per GGUF architecture, puts each back
from the file's own metadata and tensors, and holds what llama.cpp assumes where the file stores nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write `out_dir` (which must not exist yet or be empty) from the GGUF file at `gguf_path`.

    A GGUF architecture outside GGUF_FIXUPS is refused before anything is read into a model."""
    from transformers import AutoConfig, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    folder, file_name = str(gguf_path.parent), gguf_path.name

    with _one_parse_per_file():
        file = GgufFile(gguf_path)
        fixup = GGUF_FIXUPS[file.fixup_key]
        config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
        _fix_common(file, config)
        fixup.config(file, config)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        config, tensors, generation_config = fixup.load(file, config)
        fixup.finish(file, config, generation_config, tokenizer)
        out_dir.mkdir(parents=True, exist_ok=True)
        _write(out_dir, config, tensors, generation_config, tokenizer)


class GgufFile:
    """A GGUF file's metadata and tensors, read with gguf's reader (the shared one in _one_parse_per_file)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        self._reader = gguf.GGUFReader(path)
        self._string = gguf.GGUFValueType.STRING
        self.arch = str(self.value("general.architecture"))
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def fixup_key(self) -> str:
        """The GGUF_FIXUPS entry: general.architecture, but "mixtral" for a llama file with experts (how
        llama.cpp writes Mixtral). Anything else is refused here, with the list of what is read."""
        key = "mixtral" if self.arch == "llama" and (self.value("{arch}.expert_count") or 0) > 0 else self.arch
        if key not in GGUF_FIXUPS:
            raise ValueError(
                f"unsupported GGUF architecture {self.arch!r} in {self.path.name}: "
                f"supported GGUF architectures are {', '.join(GGUF_FIXUPS)}"
            )
        return key

    def value(self, key: str) -> Any:
        """A metadata value ("{arch}" stands for the file's architecture): a scalar, a list for an array,
        None when absent."""
        field = self._reader.fields.get(key.replace("{arch}", getattr(self, "arch", "")))
        if field is None:
            return None
        values = [self._decode(field.parts[i], field.types[-1]) for i in field.data]
        return values if len(field.types) > 1 else values[0]

    def _decode(self, part: Any, value_type: Any) -> Any:
        return bytes(part).decode() if value_type == self._string else part[0].item()

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, in HF's (rows, columns) order."""
        import gguf

        tensor = self._tensors[name]
        return np.array(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a copy: F32 data is the read-only file map

    def rows(self, name: str) -> int:
        return int(self._tensors[name].shape[-1])  # ggml lists dimensions innermost first


@contextlib.contextmanager
def _one_parse_per_file() -> Iterator[None]:
    """transformers parses the whole GGUF file for the tokenizer, again for the config and again for the
    weights, and GgufFile reads it too: a Gemma 3 file's 262k vocabulary strings take ~30 s per parse on
    two cores. Within this block one reader per file serves every caller (transformers imports
    gguf.GGUFReader at call time, so it finds the shared one). The reader is read-only once built."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}
    fast_reader = _fast_reader_class(original)

    def shared_reader(path: str | Path, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = fast_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _fast_reader_class(reader: type) -> type:
    """gguf's reader with its metadata read through a plain array view of the file map: it makes one small
    read per vocabulary string, and numpy.memmap's own indexing costs ~4x the rest (2.7 s -> 0.7 s for a
    49k vocabulary). The same bytes, and tensor data still maps the file."""

    class FastReader(reader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            array = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastReader


def _write(out_dir: Path, config: Any, tensors: dict[str, torch.Tensor], generation_config: Any, tokenizer: Any) -> None:
    """The folder: float32 safetensors, then config, generation config and tokenizer."""
    # A tied lm_head shares storage with the embedding; safetensors refuses shared tensors, and
    # HF folders leave the tied copy out anyway.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {name: t.detach().contiguous() for name, t in tensors.items() if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # The GGUF loader records quantization_config={quant_method: gguf}; the saved tensors are plain
    # float32, so a reader must not take the GGUF path again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _load_with_transformers(file: GgufFile, config: Any) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """transformers reads the weights (dequantized, llama.cpp's layout undone) into a model of `config`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(file.path.parent), gguf_file=file.path.name, config=config, dtype=torch.float32
    )
    model.config.architectures = [type(model).__name__]
    return model.config, model.state_dict(), model.generation_config


# --- every architecture ---------------------------------------------------------------------------------


def _fix_common(file: GgufFile, config: Any) -> None:
    """What the reader maps for some architectures only, or not exactly."""
    # GGUF stores rms_norm_eps as a float32 (1e-6 reads back as 9.999999974752427e-07): its shortest
    # decimal is the checkpoint's own value and the same float32.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    # head_dim is independent of hidden / heads in Qwen3, Gemma and Mistral: the reader maps it for a few
    # architectures only (Qwen3's default would be 128).
    if (key_length := file.value("{arch}.attention.key_length")) is not None:
        config.head_dim = int(key_length)
    # The vocabulary is the embedding's rows (the tokenizer's list may be shorter).
    config.vocab_size = file.rows("token_embd.weight")
    _fix_rope_scaling(file, config)


def _full_attention_rope(config: Any) -> dict:
    """The rope parameters of the (global) attention layers, a dict inside config.rope_parameters."""
    rope = config.rope_parameters
    return rope["full_attention"] if isinstance(rope.get("full_attention"), dict) else rope


def _fix_rope_scaling(file: GgufFile, config: Any) -> None:
    """{arch}.rope.scaling.* (linear, YaRN), which the reader drops; LongRoPE is Phi-3's (_fix_phi3)."""
    scaling, factor = file.value("{arch}.rope.scaling.type"), file.value("{arch}.rope.scaling.factor")
    if scaling not in ("linear", "yarn") or factor in (None, 1.0):
        return
    rope = _full_attention_rope(config)
    rope.update(rope_type=scaling, factor=float(factor))
    if scaling == "yarn":
        rope["original_max_position_embeddings"] = int(file.value("{arch}.rope.scaling.original_context_length"))
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := file.value(f"{{arch}}.rope.scaling.{key}")) is not None:
                rope[name] = float(value)
    config.rope_parameters = config.rope_parameters


# --- llama (Llama, Mistral) and Mixtral ---------------------------------------------------------------

# Meta's Llama 3.x rope_scaling (3.1 through 3.3): llama.cpp keeps only the per-frequency factors
# (rope_freqs), in which low and high frequency factors and the original context are not separable.
LLAMA3_FREQ_FACTORS = (1.0, 4.0)


def _fix_llama(file: GgufFile, config: Any) -> None:
    """Llama 3's rope from the rope_freqs tensor llama.cpp stores instead of rope_scaling."""
    if file.has_tensor("rope_freqs.weight"):
        rope = _full_attention_rope(config)
        rope.update(_llama3_rope(file.tensor("rope_freqs.weight"), rope["rope_theta"], config.head_dim))
        config.rope_parameters = config.rope_parameters


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """rope_type llama3 parameters that give these per-frequency factors.

    A frequency's factor is 1 (short wavelengths), `factor` (long ones) or, between L / high and L / low,
    1 / ((1 - s) / factor + s) with s = (L / wavelength - low) / (high - low). Only L / low and L / high
    matter, so low and high are Meta's (1, 4) and L is solved from a smoothed frequency (or, with none,
    placed between the last 1 and the first `factor`). The result is checked against the file's factors."""
    low, high = LLAMA3_FREQ_FACTORS
    factor = float(factors.max())
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (factors > 1.0) & ~np.isclose(factors, factor, rtol=1e-6)
    if smooth.any():
        s = (1 / factors[smooth] - 1 / factor) / (1 - 1 / factor)
        original = float(np.median(wavelengths[smooth] * (s * (high - low) + low)))
    else:  # any L with every unscaled wavelength below L / high and every scaled one above L / low
        shortest_scaled = wavelengths[factors > 1.0].min(initial=wavelengths.max() * 2)
        original = shortest_scaled * low * 0.999
    rope = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=round(original))  # fmt: skip
    expected = _llama3_factors(wavelengths, rope)
    if not np.allclose(expected, factors, rtol=1e-5):
        raise ValueError(f"rope_freqs {factors.tolist()} are not Llama 3 rope factors with low/high {low}/{high}")
    return rope


def _llama3_factors(wavelengths: np.ndarray, rope: dict) -> np.ndarray:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    smooth = (original / wavelengths - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, between))


def _load_mixtral(file: GgufFile, config: Any) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """llama.cpp writes Mixtral as the llama architecture with stacked experts, which transformers' reader
    would load as a dense Llama (its MLP left random). It reads the rest; the experts come from the file."""
    from transformers import MixtralConfig

    experts, intermediate = int(file.value("{arch}.expert_count")), config.intermediate_size
    config.intermediate_size = 1  # the dense MLP the reader builds has no weights in the file: keep it tiny
    llama_config, tensors, generation_config = _load_with_transformers(file, config)
    tensors = {name: t for name, t in tensors.items() if ".mlp." not in name}
    for i in range(llama_config.num_hidden_layers):
        gate, up = (torch.from_numpy(file.tensor(f"blk.{i}.ffn_{w}_exps.weight")) for w in ("gate", "up"))
        tensors[f"model.layers.{i}.mlp.gate.weight"] = torch.from_numpy(file.tensor(f"blk.{i}.ffn_gate_inp.weight"))
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = torch.from_numpy(file.tensor(f"blk.{i}.ffn_down_exps.weight"))
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    mixtral = MixtralConfig(
        **{key: getattr(llama_config, key) for key in keys if getattr(llama_config, key, None) is not None},
        intermediate_size=intermediate, num_local_experts=experts,
        num_experts_per_tok=int(file.value("{arch}.expert_used_count")), sliding_window=None,
    )  # fmt: skip
    mixtral.architectures = ["MixtralForCausalLM"]
    return mixtral, tensors, generation_config


# --- qwen3moe ------------------------------------------------------------------------------------------


def _fix_qwen3moe(file: GgufFile, config: Any) -> None:
    """The experts' intermediate size; llama.cpp's qwen3moe has experts in every layer."""
    config.moe_intermediate_size = int(file.value("{arch}.expert_feed_forward_length"))
    config.mlp_only_layers = []
    config.decoder_sparse_step = 1


# --- phi3 ------------------------------------------------------------------------------------------------


def _fix_phi3(file: GgufFile, config: Any) -> None:
    """Partial rotary (rope.dimension_count of head_dim), LongRoPE from the rope_factors_* tensors and the
    original context, and the window (0: none, Phi-4)."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    rope_dims = file.value("{arch}.rope.dimension_count") or head_dim
    if rope_dims != head_dim:
        config.partial_rotary_factor = rope["partial_rotary_factor"] = rope_dims / head_dim
    original = file.value("{arch}.rope.scaling.original_context_length")
    if original is not None:
        config.original_max_position_embeddings = int(original)
    if file.has_tensor("rope_factors_long.weight"):
        rope.update(rope_type="longrope", original_max_position_embeddings=int(original),
                    long_factor=file.tensor("rope_factors_long.weight").tolist(),
                    short_factor=file.tensor("rope_factors_short.weight").tolist())  # fmt: skip
    config.rope_parameters = rope
    config.sliding_window = file.value("{arch}.attention.sliding_window") or None


# --- gemma2, gemma3 --------------------------------------------------------------------------------------


def _gemma_query_scalar(config: Any, big_model_layers: int) -> int:
    """llama.cpp scales queries by head_dim ** -0.5, except in the 27B models (told by their layer count),
    by (hidden / heads) ** -0.5: query_pre_attn_scalar has no GGUF key."""
    if config.num_hidden_layers == big_model_layers:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim


def _fix_gemma2(file: GgufFile, config: Any) -> None:
    """Soft-capping (llama.cpp's defaults when absent), the query scale, window layers alternating."""
    config.attn_logit_softcapping = float(file.value("{arch}.attn_logit_softcapping") or 50.0)
    config.final_logit_softcapping = float(file.value("{arch}.final_logit_softcapping") or 30.0)
    config.query_pre_attn_scalar = _gemma_query_scalar(config, 46)
    config.layer_types = [_layer_type(i, 2) for i in range(config.num_hidden_layers)]


def _layer_type(layer: int, pattern: int) -> str:
    """llama.cpp's window layers: all but every `pattern`-th."""
    return "sliding_attention" if layer % pattern < pattern - 1 else "full_attention"


GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's base for gemma3's window layers when the file has none


def _fix_gemma3_config(file: GgufFile, config: Any) -> None:
    """Gemma 3 beside what the reader gets right (checked against Google's config.json for Gemma 3 270M:
    hidden, layers, heads, KV heads, head_dim, intermediate, vocab, sliding_window, context, tied
    embeddings, the global layers' rope base): five window layers to one global (llama.cpp hard-codes
    it), the query scale, the window layers' rope base (rope.freq_base_swa, else 10000), final soft-capping
    when stored. The global layers' linear scaling (8x in 4B and up) comes in _fix_rope_scaling."""
    config.layer_types = [_layer_type(i, 6) for i in range(config.num_hidden_layers)]
    config.query_pre_attn_scalar = _gemma_query_scalar(config, 62)
    local_theta = file.value("{arch}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA
    config.rope_parameters["sliding_attention"] = {"rope_type": "default", "rope_theta": float(local_theta)}
    config.rope_parameters = config.rope_parameters
    if (softcap := file.value("{arch}.final_logit_softcapping")) is not None:
        config.final_logit_softcapping = float(softcap)


def _fix_gemma3_chat(file: GgufFile, config: Any, generation_config: Any, tokenizer: Any) -> None:
    """End of turn and the chat template."""
    # llama.cpp writes one eos id (<eos>, 1), but a chat answer ends with <end_of_turn> (106); Google's
    # config.json and generation_config.json list both, [1, 106]. Without 106 a chat answer runs on into
    # a made-up next turn (Freight's engine reads the eos ids of config.json, transformers' generate
    # those of generation_config.json).
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        eos = config.eos_token_id
        eos_ids = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        eos_ids += [end_of_turn] if end_of_turn not in eos_ids else []
        config.eos_token_id = eos_ids
        generation_config.eos_token_id = list(eos_ids)
    # A GGUF without tokenizer.chat_template (Google's 270M: converted from the pretrained model) leaves
    # the tokenizer with none; Gemma 3's is the format the family uses.
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE


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


def _no_config_fix(file: GgufFile, config: Any) -> None:
    """Nothing beyond _fix_common."""


def _no_finish(file: GgufFile, config: Any, generation_config: Any, tokenizer: Any) -> None:
    """Nothing to add once loaded."""


@dataclass(frozen=True)
class GgufFixup:
    """What transformers' GGUF reader leaves out for one GGUF architecture, restored from the file."""

    config: Callable[[GgufFile, Any], None] = _no_config_fix  # before the model is built: shapes, features
    load: Callable[[GgufFile, Any], tuple[Any, dict[str, torch.Tensor], Any]] = _load_with_transformers
    finish: Callable[[GgufFile, Any, Any, Any], None] = _no_finish  # config, generation config, tokenizer


# The single source of truth for which GGUF architectures Freight reads and what each needs; keys are
# general.architecture as llama.cpp writes it (Mistral is "llama"; "mixtral" is a llama file with experts).
GGUF_FIXUPS: Mapping[str, GgufFixup] = MappingProxyType(
    {
        "llama": GgufFixup(config=_fix_llama),
        "mixtral": GgufFixup(config=_fix_llama, load=_load_mixtral),
        "qwen2": GgufFixup(),
        "qwen3": GgufFixup(),
        "qwen3moe": GgufFixup(config=_fix_qwen3moe),
        "phi3": GgufFixup(config=_fix_phi3),
        "gemma2": GgufFixup(config=_fix_gemma2),
        "gemma3": GgufFixup(config=_fix_gemma3_config, finish=_fix_gemma3_chat),
    }
)
