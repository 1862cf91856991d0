"""The results Parquet of a summarize job: the usual columns plus `summary`, `windows` (how many token
windows the document was summarized through: 1 when it fit, 0 for an error row) and the document's
id column from the input. Rewritten batch by batch at finalize, so memory stays bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from jobs.domain.summarize_spec import SummarizeSpec, output_id_column
from storage.arrow_path import ParquetSource, parquet_file, read_schema
from storage.models import Job
from storage.status import COMPLETED_FINISH_REASONS
from storage.summary_store import window_counts

BATCH_ROWS = 8192


class ColumnCursor:
    """Reads one column of a Parquet file front to back in slices of any size (the file's own
    batches follow its row groups, which need not line up with another file's)."""

    def __init__(self, source: ParquetSource, column: str) -> None:
        self.batches = parquet_file(source).iter_batches(batch_size=BATCH_ROWS, columns=[column])
        self.buffer: pa.Array | None = None

    def take(self, count: int) -> pa.Array:
        pieces: list[pa.Array] = []
        while count > 0:
            if self.buffer is None or len(self.buffer) == 0:
                self.buffer = next(self.batches).column(0)
            piece = self.buffer.slice(0, count)
            pieces.append(piece)
            self.buffer = self.buffer.slice(len(piece))
            count -= len(piece)
        return pa.concat_arrays(pieces) if len(pieces) > 1 else pieces[0]


def add_summary_columns(session: Session, job: Job, job_input: ParquetSource, results_path: Path) -> None:
    spec = SummarizeSpec(**job.params["summarize"])
    input_schema = read_schema(job_input)
    id_column = output_id_column(input_schema.names, spec)
    results = pq.ParquetFile(results_path)
    schema = results.schema_arrow
    copy_id = id_column is not None and id_column not in schema.names
    if copy_id:
        schema = schema.insert(2, input_schema.field(id_column))
    schema = schema.append(pa.field("summary", pa.string())).append(pa.field("windows", pa.int32()))
    ids = ColumnCursor(job_input, id_column) if copy_id else None
    temp = results_path.with_name(results_path.name + ".summary")
    start = 0
    try:
        with pq.ParquetWriter(temp, schema) as writer:
            for batch in results.iter_batches(batch_size=BATCH_ROWS):
                stop = start + batch.num_rows
                counts = window_counts(session, job.id, start, stop)
                reasons = batch.column("finish_reason").to_pylist()
                windows = [
                    counts.get(start + offset, 1 if reason in COMPLETED_FINISH_REASONS else 0)
                    for offset, reason in enumerate(reasons)
                ]
                columns = dict(zip(batch.schema.names, batch.columns, strict=True))
                if ids is not None:
                    columns[id_column] = ids.take(batch.num_rows)
                columns["summary"] = batch.column("output_text")
                columns["windows"] = pa.array(windows, pa.int32())
                writer.write_table(pa.table([columns[name] for name in schema.names], schema=schema))
                start = stop
        os.replace(temp, results_path)
    finally:
        if temp.exists():
            temp.unlink()
