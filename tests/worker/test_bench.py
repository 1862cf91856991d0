"""ShareGPT workload and the `freight bench` harness (tiny model, a handful of requests)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kernels.platform import TIERS
from worker.bench.run import parse_args, prefix_agreement
from worker.bench.sharegpt import (
    build_workload,
    first_human_text,
    first_human_turns,
    iter_conversations,
    iter_json_array,
    texts,
)
from worker.commands import bench, models_pull


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 5, 8, 13, 1 << 20])
def test_json_array_is_read_in_chunks_and_stops_at_the_broken_tail(chunk_chars: int) -> None:
    complete = ' \n[ {"a": [1, 2]},\n {"b": "x, ]"} , {"c": {}} ]'
    truncated = '[{"a": [1, 2]}, {"b": "x, ]"}, {"c": {"d": 1'

    assert list(iter_json_array(io.StringIO(complete), chunk_chars)) == [
        {"a": [1, 2]},
        {"b": "x, ]"},
        {"c": {}},
    ]
    assert list(iter_json_array(io.StringIO(truncated), chunk_chars)) == [{"a": [1, 2]}, {"b": "x, ]"}]
    with pytest.raises(ValueError, match="not a JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}'), chunk_chars))


def test_sharegpt_file_holds_conversations_0_to_17670() -> None:
    last_index, last = max(iter_conversations(), key=lambda pair: pair[0])
    assert last_index == 17670
    assert last["conversations"]


def test_first_human_turns_skip_unusable_conversations() -> None:
    turns = first_human_turns(15000, 256)

    assert len(turns) == 256 and turns[0][0] == 15000 and turns[-1][0] == 15371
    kept = {index for index, _ in turns}
    skipped = [conv for index, conv in iter_conversations() if 15000 <= index <= 15371 and index not in kept]
    assert len(skipped) == 372 - 256
    assert all(first_human_text(conv) is None for conv in skipped)
    assert texts(15000, 3) == [text for _, text in turns[:3]]
    with pytest.raises(ValueError, match="17671 complete conversations"):
        first_human_turns(17600, 1000)


def test_first_human_text_rules() -> None:
    assert first_human_text({"conversations": [{"from": "human", "value": " hi "}]}) == " hi "
    assert first_human_text({"conversations": [{"from": "gpt", "value": "hi"}]}) is None
    assert first_human_text({"conversations": [{"from": "human", "value": " \n"}]}) is None
    assert first_human_text({"conversations": []}) is None


def test_workload_is_templated_and_truncated(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    full = build_workload(tokenizer, start=0, n=8, max_prompt_len=4096, output_len=7)
    cut = build_workload(tokenizer, start=0, n=8, max_prompt_len=40, output_len=7)

    assert full.output_len == 7 and len(full) == 8
    head = tokenizer.encode("<|im_start|>system\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    for ids in full.prompt_token_ids:
        assert ids[: len(head)] == head and ids[-len(tail) :] == tail
    for long, short in zip(full.prompt_token_ids, cut.prompt_token_ids, strict=True):
        assert short == long[:40]
    assert cut.truncated_prompts == sum(len(ids) > 40 for ids in full.prompt_token_ids) > 0


@pytest.mark.slow
def test_workload_matches_the_vllm_baseline_figures(smollm2_path: Path) -> None:
    # Figures of shared/bench/workload.py on the same file and tokenizer (the vLLM baseline's input).
    workload = build_workload(AutoTokenizer.from_pretrained(smollm2_path), start=15000, n=256)
    assert workload.describe() == {
        "requests": 256,
        "first_file_index": 15000,
        "last_file_index": 15371,
        "prompt_tokens": 61964,
        "prompt_len_max": 1024,
        "output_len": 128,
        "max_prompt_len": 1024,
        "truncated_prompts": 23,
    }


def test_prefix_agreement() -> None:
    assert prefix_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == pytest.approx((1 + 1 / 3) / 2)


def test_bench_rejects_unknown_systems() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--systems", "transformers,sglang"])
    with pytest.raises(SystemExit):  # vLLM runs only from a venv of its own
        parse_args(["--systems", "transformers,vllm"])


def test_models_pull_returns_the_cached_folder(smollm2_path: Path, models_cache_dir: Path) -> None:
    assert models_pull("smollm2-135m", str(models_cache_dir)) == smollm2_path


def run_bench(model_dir: Path, out: Path, systems: str, dtype: str, *extra: str) -> list[dict]:
    argv = ["--n", "4", "--start", "0", "--output-len", "4", "--model", str(model_dir), "--systems", systems, *extra]
    argv += ["--dtype", dtype, "--kv-cache-memory-gb", "0.05", "--json-out", str(out)]
    assert bench(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_bench_runs_every_system_on_the_same_workload(tiny_llama_dir: Path, tmp_path: Path) -> None:
    machine, *systems, summary = run_bench(
        tiny_llama_dir, tmp_path / "bench.jsonl", "transformers,freight,freight-bf16-int8", "bfloat16"
    )

    assert machine["machine"]["tier"] in TIERS
    assert [s["system"] for s in systems] == ["transformers", "freight", "freight-bf16-int8"]
    assert summary["workload"]["prompt_tokens"] == systems[0]["prompt_tokens"] > 0
    for row in systems:
        assert row["requests"] == 4 and row["output_tokens"] == 16
        assert row["prompt_tokens"] == systems[0]["prompt_tokens"]
        assert row["elapsed_s"] > 0 and row["total_tokens_per_s"] > 0 and row["load_s"] > 0
    assert systems[0]["padded_prompt_positions"] >= systems[0]["prompt_tokens"]
    assert systems[1]["engine_stats"]["output_tokens"] == 16
    assert systems[1]["engine_stats"]["tier"] == machine["machine"]["tier"]
    assert systems[2]["plan"]["scheme"].startswith("bfloat16+int8/")  # an explicit scheme is honoured
    assert summary["ratios_vs"] == "transformers"
    assert (
        set(summary["ratios"]) == set(summary["greedy_prefix_agreement"]) == {"freight", "freight-bf16-int8"}
    )


def test_bench_float32_freight_agrees_with_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Unquantized float32 Freight must pick the same greedy tokens as transformers on the same prompts.
    *_, summary = run_bench(
        tiny_llama_dir, tmp_path / "bench.jsonl", "transformers,freight-fp32", "float32", "--kv-cache-dtype", "auto"
    )

    assert summary["greedy_prefix_agreement"] == {"freight-fp32": 1.0}
