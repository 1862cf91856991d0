"""An OpenAI batch input file made into its job's rows a chunk at a time (jobs/domain/openai_rows.py):
the same rows and line errors as reading it whole (parse_batch_file), lines cut across chunk borders,
an overlong line refused without being held, and a large file read in bounded chunks with a bounded
amount of memory (tracemalloc's peak, far below the file's size)."""

from __future__ import annotations

import io
import json
import tracemalloc

import pyarrow.parquet as pq
import pytest

from jobs.domain.errors import InputError
from jobs.domain.json_limits import JsonLimits
from jobs.domain.openai_batch import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, parse_batch_file, read_lines
from jobs.domain.openai_rows import read_batch_rows

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

MODEL = "smollm2-135m"


def chat(custom_id: str, text: str = "Hi", **body) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT_ENDPOINT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], **body}}  # fmt: skip
    return json.dumps(line).encode()


class CountingReader:
    """A byte stream that records the size of every read asked of it."""

    def __init__(self, data: bytes) -> None:
        self.source = io.BytesIO(data)
        self.asked: list[int] = []

    def read(self, size: int) -> bytes:
        self.asked.append(size)
        return self.source.read(size)


def test_lines_are_cut_across_chunk_borders() -> None:
    data = b'{"a": 1}\n\n  \n{"b": 22}\r\n' + b"x" * 40 + b'\n{"c": 3}'
    for chunk in (1, 2, 3, 7, 64):
        lines = list(read_lines(io.BytesIO(data).read, max_line_bytes=30, chunk_bytes=chunk))
        # numbering counts blank lines; the 40-byte line is over the limit: None, not its bytes
        assert lines == [(1, b'{"a": 1}'), (4, b'{"b": 22}\r'), (5, None), (6, b'{"c": 3}')], chunk


def test_streamed_rows_equal_the_whole_file_reading() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    lines = [chat(f"r{i}", f"Count to {i}.", max_tokens=4 + i % 3) for i in range(9)]
    lines[5] = b"{not json"
    lines[6] = chat("r1")  # a repeated custom_id
    lines += [
        chat("late", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    ]
    lines += [chat("other", **{"model": "other-model"})]
    data = b"\n".join(lines) + b"\n"
    whole = parse_batch_file(data, CHAT_ENDPOINT)
    # Row groups of 2 rows: the structured columns first appear after three row groups were written
    # without them, so the rows so far are copied into a file that has them.
    with read_batch_rows(io.BytesIO(data).read, CHAT_ENDPOINT, chunk_bytes=16, row_group_rows=2) as rows:
        streamed = pq.ParquetFile(rows.file)
        assert streamed.read().to_pylist() == pq.read_table(io.BytesIO(whole.to_parquet())).to_pylist()
        assert streamed.metadata.num_row_groups == 4
        assert rows.errors == whole.errors and len(rows.errors) == 3
        assert rows.lines == whole.lines == 11
        assert list(rows.row_lines) == [request.line for request in whole.requests]
        assert rows.first == whole.requests[0]


def test_file_level_problems_are_input_errors() -> None:
    with pytest.raises(InputError, match="no requests"):
        read_batch_rows(io.BytesIO(b"\n \n").read, CHAT_ENDPOINT)
    with pytest.raises(InputError, match="endpoint"):
        read_batch_rows(io.BytesIO(chat("a")).read, "/v1/embeddings")
    with read_batch_rows(io.BytesIO(b"[1]\n").read, COMPLETIONS_ENDPOINT) as rows:
        assert rows.rows == 0 and rows.first is None and len(rows.errors) == 1


def test_an_overlong_line_is_its_own_error_and_never_held() -> None:
    limits = JsonLimits(max_bytes=1000)
    data = chat("a") + b"\n" + b"[" + b" " * 5000 + b"]\n" + chat("b") + b"\n"
    with read_batch_rows(io.BytesIO(data).read, CHAT_ENDPOINT, limits=limits, chunk_bytes=256) as rows:
        assert rows.rows == 2 and [error.line for error in rows.errors] == [2]
        assert "the limit is 1000 (max_bytes)" in rows.errors[0].message
        assert rows.errors[0].code == "json_limit"


def test_a_large_file_is_read_in_chunks_with_bounded_memory() -> None:
    """1,200 lines of ~8 KB (about 10 MB): every read asks for one 64 KB chunk, and the conversion's peak
    of Python memory stays a fraction of the file. Reading it whole held the bytes, then every parsed
    request, then the Parquet bytes: several times the file (docs/benchmarks.md#openai-input-streaming)."""
    filler = "lorem ipsum dolor sit amet " * 300
    data = b"\n".join(chat(f"id-{i}", f"{i} {filler}") for i in range(1200)) + b"\n"
    assert len(data) > 9_000_000
    reader = CountingReader(data)
    chunk = 64 * 1024
    tracemalloc.start()
    try:
        rows = read_batch_rows(reader.read, CHAT_ENDPOINT, chunk_bytes=chunk, row_group_rows=32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with rows:
        assert set(reader.asked) == {chunk} and len(reader.asked) == -(-len(data) // chunk) + 1
        assert rows.rows == 1200 and rows.errors == []
        parquet = pq.ParquetFile(rows.file)
        assert parquet.metadata.num_rows == 1200 and parquet.metadata.num_row_groups == 1200 // 32 + 1
        assert parquet.read_row_group(37).column("custom_id")[-1].as_py() == "id-1199"
    assert peak < len(data) / 3, f"peak {peak / 1e6:.1f} MB for a {len(data) / 1e6:.1f} MB file"
