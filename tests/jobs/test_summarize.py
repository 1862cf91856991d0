"""The summarize task without services: parameters, the shipped sample documents, and `freight summarize`
(embedded) on short, long and empty documents with the tiny model and a 512-token context, then the
job's report opened in headless Chromium."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from jobs.domain.errors import InputError
from jobs.domain.sample_docs import LONG_DOCUMENTS, sample_docs_table
from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from tests.service.browser import dump_dom, png_colors, screenshot
from tests.service.fixtures import FREIGHT_BIN
from worker.embedded import run_embedded

SMALL_ENGINE = {
    "FREIGHT_MAX_MODEL_LEN": "512",
    "FREIGHT_NUM_THREADS": "1",
    "FREIGHT_KV_CACHE_MEMORY_GB": "0.25",
    "FREIGHT_MAX_NUM_SEQS": "16",
    "FREIGHT_MAX_NUM_BATCHED_TOKENS": "1024",
    "FREIGHT_SHARD_SIZE": "4",
}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"task": "summarize", "style": "a", "template": "{text}"}, "either style or template"),
        ({"task": "summarize", "template": "{title}: {text}"}, "exactly one placeholder"),
        ({"task": "summarize", "max_tokens": 600}, "at most a quarter of the model context (512 of 2048"),
        (
            {"task": "summarize", "long_documents": "truncate", "max_tokens": 1025},
            "at most half of the model",
        ),
        ({"task": "summarize", "prompt_column": "body"}, "reads its documents from `column`"),
        ({"style": "one line"}, "style applies only to task 'summarize'"),
        ({"long_documents": "truncate"}, "long_documents applies only to task 'summarize'"),
    ],
)
def test_bad_summarize_parameters_are_refused_clearly(params: dict, message: str) -> None:
    service = JobService(Settings(max_model_len=2048), None, None, None, allow_any_model=True)
    with pytest.raises(InputError, match=re.escape(message)):
        service.resolve(JobParams(**params))


def test_summarize_parameters_resolve_to_the_document_column_and_the_chat_template() -> None:
    service = JobService(Settings(max_model_len=2048), None, None, None, allow_any_model=True)
    resolved = service.resolve(JobParams(task="summarize", column="body", max_tokens=512))
    assert (resolved.prompt_column, resolved.chat, resolved.template) == ("body", True, None)
    assert resolved.summarize.style == "one paragraph" and resolved.summarize.long_documents == "map_reduce"
    truncating = service.resolve(JobParams(task="summarize", long_documents="truncate", max_tokens=1024))
    assert truncating.summarize.long_documents == "truncate"


def test_the_sample_set_holds_documents_longer_than_the_context(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's tokenizer
    table = sample_docs_table()
    assert table.num_rows == 20 + len(LONG_DOCUMENTS)
    lengths = {
        doc_id: len(tokenizer(text, add_special_tokens=False)["input_ids"])
        for doc_id, text in zip(
            table.column("custom_id").to_pylist(), table.column("text").to_pylist(), strict=True
        )
    }
    assert sum(length > 2048 for length in lengths.values()) >= 2, lengths
    short_ids = table.column("custom_id").to_pylist()[:20]
    assert all(lengths[doc_id] < 400 for doc_id in short_ids)


def documents() -> pa.Table:
    """Short, long (two and many windows at 512 tokens) and unusable documents, with a doc_id column."""
    docs = sample_docs_table()
    by_id = dict(zip(docs.column("custom_id").to_pylist(), docs.column("text").to_pylist(), strict=True))
    return pa.table(
        {
            "doc_id": ["bread", "design", "empty", "bees", "survey", "blank", "missing"],
            "text": [
                by_id["bread"],
                by_id["freight-design"],
                "",
                by_id["bees"],
                by_id["river-survey"],
                "   \n ",
                None,
            ],
        }
    )


def test_freight_summarize_gives_one_summary_per_document_through_windows(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    source, out, metrics_path = tmp_path / "docs.parquet", tmp_path / "summaries.parquet", tmp_path / "m.json"
    pq.write_table(documents(), source)
    env = {"PATH": str(Path(FREIGHT_BIN).parent), "FREIGHT_HOME": str(tmp_path / "home"), **SMALL_ENGINE}
    run = subprocess.run(
        [FREIGHT_BIN, "summarize", str(source), "--column", "text", "-o", str(out), "--max-tokens", "8"]
        + ["--model", str(tiny_llama_dir), "--metrics-json", str(metrics_path), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = pq.read_table(out).to_pylist()
    assert [row["doc_id"] for row in rows] == documents().column("doc_id").to_pylist()
    by_id = {row["doc_id"]: row for row in rows}
    for doc_id in ("bread", "bees"):
        assert by_id[doc_id]["windows"] == 1 and by_id[doc_id]["finish_reason"] in ("stop", "length")
        assert (
            by_id[doc_id]["summary"] == by_id[doc_id]["output_text"] and by_id[doc_id]["output_tokens"] <= 8
        )
    assert by_id["survey"]["windows"] == 2  # 650 tokens: two windows of a 512-token context
    assert by_id["design"]["windows"] >= 5  # 2,189 tokens
    for doc_id in ("design", "survey"):
        row = by_id[doc_id]
        assert row["finish_reason"] in ("stop", "length") and row["error"] is None and row["summary"]
        # The row counts every request of the document: its windows, then at least one reduce.
        assert row["output_tokens"] > 8 and row["prompt_tokens"] > 512
    assert by_id["empty"]["error"] == "the document is empty" and by_id["blank"]["finish_reason"] == "error"
    assert by_id["missing"]["error"] == "column 'text' is null"
    assert all(by_id[doc_id]["windows"] == 0 for doc_id in ("empty", "blank", "missing"))

    metrics = json.loads(metrics_path.read_text())
    assert (metrics["rows"], metrics["rows_completed"], metrics["rows_failed"]) == (7, 4, 3)
    assert metrics["windows"] == by_id["design"]["windows"] + by_id["survey"]["windows"]
    assert metrics["documents_split"] == 2 and metrics["reduce_requests"] >= 2
    assert metrics["output_tokens"] == sum(row["output_tokens"] for row in rows)
    assert metrics["prompt_tokens"] == sum(row["prompt_tokens"] for row in rows)
    # Every generated token went through the engine: tokens computed (or served from the prefix cache, as
    # the shared instruction of every window is) cover windows and reduces too.
    served = metrics["computed_tokens"] + metrics["cached_prompt_tokens"]
    assert served >= metrics["prompt_tokens"] + metrics["output_tokens"] - 64

    job_id = re.search(r"job (job_\w+) completed", run.stdout).group(1)
    report = tmp_path / "report.html"
    made = subprocess.run(
        [FREIGHT_BIN, "report", "--local", job_id, "-o", str(report)], env=env, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    check_report_in_chromium(report.as_uri(), job_id, "summarize-report.png")


def check_report_in_chromium(url: str, job_id: str, artifact: str) -> None:
    """The report renders: its sections and six charts are in the DOM, and the screenshot is not blank."""
    dom = dump_dom(url)
    assert job_id in dom and 'id="job-status"' in dom and ">completed<" in dom
    for title in (
        "Prompt length",
        "Output length",
        "Throughput over time",
        "Running batch size over time",
        "KV-cache use over time",
        "Tokens computed vs static padded batches",
    ):
        assert f'aria-label="{title}"' in dom, title
    assert dom.count("<svg") == 6 and "<rect" in dom and "<polyline" in dom
    assert 'data-key="cost_usd"' in dom
    image = screenshot(url, artifact, height=2400)
    assert image.stat().st_size > 20_000 and png_colors(image) > 50


def test_truncate_keeps_the_start_of_a_long_document(tiny_llama_dir: Path, tmp_path: Path) -> None:
    pq.write_table(documents().slice(1, 1), tmp_path / "long.parquet")
    settings = Settings(
        home=tmp_path / "home", max_model_len=512, num_threads=1, kv_cache_memory_gb=0.25, max_num_seqs=4
    )
    params = JobParams(model=str(tiny_llama_dir), task="summarize", long_documents="truncate", max_tokens=8)
    result = run_embedded(tmp_path / "long.parquet", tmp_path / "out.parquet", params, settings)
    assert result.status == "completed"
    (row,) = pq.read_table(result.output_path).to_pylist()
    assert row["windows"] == 1 and row["finish_reason"] in ("stop", "length")
    assert 400 < row["prompt_tokens"] <= 512 - 8 and result.metrics["windows"] == 0
