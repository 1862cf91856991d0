"""An OpenAI batch input file made into the rows of its job without ever holding the file: it is read a
chunk at a time (openai_batch.read_lines), each line parsed and checked as it comes (BatchReader), and
the good lines are written to a local Parquet file a row group at a time. What stays in memory is one
chunk, one row group's requests, and a few bytes per line (its custom_id, its line number, a refused
line's error), which MAX_LINES bounds; not the file, nor its parsed requests.

The Parquet file is an anonymous temporary file (tempfile.TemporaryFile: it has no name from the start),
so nothing is left in the temp folder on any path, an exception or a killed process included."""

from __future__ import annotations

import tempfile
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.domain.grammar_check import GrammarRefusal
from jobs.domain.json_limits import JsonLimits
from jobs.domain.openai_batch import (
    DEFAULT_LINE_LIMITS,
    BatchReader,
    BatchRequest,
    LineError,
    read_lines,
    rows_table,
    structured_type,
)
from jobs.domain.schemas import JobParams
from jobs.domain.structured_spec import STRUCTURED_COLUMNS

ROW_GROUP_ROWS = 2048
READ_CHUNK_BYTES = 1 << 20


@dataclass
class BatchRows:
    """The job's rows of a batch input file, in a local Parquet file (close() drops it)."""

    endpoint: str
    lines: int  # non-blank lines read
    file: BinaryIO  # the Parquet rows, at offset 0; empty when no line was good
    row_lines: array  # the line of each row (row i came from line row_lines[i])
    errors: list[LineError]  # refused lines, in line order
    first: BatchRequest | None  # the first good line: the batch's model and stop list

    @property
    def rows(self) -> int:
        return len(self.row_lines)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> BatchRows:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def read_batch_rows(
    read: Callable[[int], bytes],
    endpoint: str,
    check: Callable[[JobParams], object] | None = None,
    grammar_refusal: GrammarRefusal | None = None,
    limits: JsonLimits = DEFAULT_LINE_LIMITS,
    *,
    chunk_bytes: int = READ_CHUNK_BYTES,
    row_group_rows: int = ROW_GROUP_ROWS,
) -> BatchRows:
    """The rows of the file that `read(n)` returns the bytes of (a stream from the job-file store),
    checked line by line as parse_batch_file checks them; InputError for a file-level problem."""
    reader = BatchReader(endpoint, check, grammar_refusal, limits)
    writer = _RowsWriter(endpoint, row_group_rows)
    try:
        for request in reader.requests(read_lines(read, limits.max_bytes, chunk_bytes)):
            writer.add(request)
        writer.finish()
    except BaseException:
        writer.discard()
        raise
    return BatchRows(endpoint, reader.lines, writer.file, writer.row_lines, reader.errors, reader.first)


class _RowsWriter:
    """Requests into a Parquet file, a row group at a time. The structured columns are written when a
    request has a response_format: when the first one comes after row groups without them, the rows so
    far are copied (a row group at a time) into a new file that has them, null."""

    def __init__(self, endpoint: str, group_rows: int) -> None:
        self.endpoint = endpoint
        self.group_rows = group_rows
        self.file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 - BatchRows closes it
        self.writer: pq.ParquetWriter | None = None
        self.structured = False
        self.pending: list[BatchRequest] = []
        self.row_lines = array("q")

    def add(self, request: BatchRequest) -> None:
        self.pending.append(request)
        self.row_lines.append(request.line)
        if len(self.pending) >= self.group_rows:
            self._flush()

    def finish(self) -> None:
        self._flush()
        if self.writer is not None:
            self.writer.close()
        self.file.seek(0)

    def discard(self) -> None:
        if self.writer is not None and self.writer.is_open:
            try:
                self.writer.close()
            except (OSError, pa.ArrowException):
                pass  # the rows are dropped anyway
        self.file.close()

    def _flush(self) -> None:
        if not self.pending:
            return
        needs = any(request.structured is not None for request in self.pending)
        if self.writer is None:
            self.structured = needs
        elif needs and not self.structured:
            self._widen()
        table = rows_table(self.pending, self.endpoint, structured=self.structured)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.file, table.schema)
        self.writer.write_table(table)
        self.pending = []

    def _widen(self) -> None:
        assert self.writer is not None
        self.writer.close()
        old, self.file = self.file, tempfile.TemporaryFile()  # noqa: SIM115 - closed like the first
        schema = rows_table([], self.endpoint, structured=True).schema
        self.writer = pq.ParquetWriter(self.file, schema)
        with old:
            old.seek(0)
            written = pq.ParquetFile(old)
            for group in range(written.num_row_groups):
                table = written.read_row_group(group)
                for name in STRUCTURED_COLUMNS:
                    table = table.append_column(name, pa.nulls(table.num_rows, structured_type(name)))
                self.writer.write_table(table.cast(schema))
        self.structured = True
