"""The results Parquet: one row per input row, ordered by row_index. While a job runs it holds the
rows finished so far; at finalize every input row is there (rows never run are `cancelled`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from storage.arrow_path import parquet_file
from storage.input_set import JobInput, input_schema, input_sources
from storage.models import Job
from storage.result_record import RESULT_ARROW_TYPES, RESULT_COLUMNS, ResultRecord
from storage.result_store import iter_results, results_between
from storage.status import FinishReason

# One column per ResultRecord field, in its order, with the field's Arrow type.
RESULTS_SCHEMA = pa.schema([(name, getattr(pa, RESULT_ARROW_TYPES[name])()) for name in RESULT_COLUMNS])
INPUT_BATCH_ROWS = 8192


def write_partial_results(session: Session, job_id: str, out_path: Path) -> int:
    """Rows stored so far, ordered by row_index. Returns the number written."""
    written = 0
    with pq.ParquetWriter(out_path, RESULTS_SCHEMA) as writer:
        for batch in iter_results(session, job_id):
            columns = {name: [getattr(row, name) for row in batch] for name in RESULT_COLUMNS}
            writer.write_table(pa.table(columns, schema=RESULTS_SCHEMA))
            written += len(batch)
    return written


def write_final_results(session: Session, job: Job, job_input: JobInput, out_path: Path) -> int:
    """Walk the input's custom_ids batch by batch (file by file, for an input by reference) and pair each
    row with its stored result."""
    has_custom_id = "custom_id" in input_schema(job_input).names
    missing_reason = FinishReason.CANCELLED if job.cancel_requested else FinishReason.ERROR
    missing_error = "cancelled before this row ran" if job.cancel_requested else "no result was recorded"
    start = 0
    batches = (
        batch
        for source in input_sources(job_input)
        for batch in parquet_file(source).iter_batches(
            batch_size=INPUT_BATCH_ROWS, columns=["custom_id"] if has_custom_id else []
        )
    )
    with pq.ParquetWriter(out_path, RESULTS_SCHEMA) as writer:
        for batch in batches:
            stop = start + batch.num_rows
            custom_ids = batch.column("custom_id").to_pylist() if has_custom_id else None
            stored = results_between(session, job_id=job.id, start=start, stop=stop)
            out: dict[str, list] = {name: [] for name in RESULT_COLUMNS}
            for offset in range(batch.num_rows):
                index = start + offset
                record = stored.get(index)
                if record is None:
                    custom_id = custom_ids[offset] if custom_ids else str(index)
                    record = ResultRecord.failed(index, custom_id, missing_error, missing_reason)
                for name in RESULT_COLUMNS:
                    out[name].append(getattr(record, name))
            writer.write_table(pa.table(out, schema=RESULTS_SCHEMA))
            start = stop
    return start
