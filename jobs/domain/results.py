"""The results Parquet: one row per input row, ordered by row_index. While a job runs it holds the
rows finished so far; at finalize every input row is there (rows never run are `cancelled`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from storage.models import Job
from storage.result_store import RESULT_COLUMNS, iter_results, results_between
from storage.status import FinishReason

RESULTS_SCHEMA = pa.schema(
    [
        ("row_index", pa.int64()),
        ("custom_id", pa.string()),
        ("output_text", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
    ]
)
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


def write_final_results(session: Session, job: Job, input_path: Path, out_path: Path) -> int:
    """Walk the input's custom_ids batch by batch and pair each row with its stored result."""
    parquet = pq.ParquetFile(input_path)
    has_custom_id = "custom_id" in parquet.schema_arrow.names
    missing_reason = FinishReason.CANCELLED if job.cancel_requested else FinishReason.ERROR
    missing_error = "cancelled before this row ran" if job.cancel_requested else "no result was recorded"
    start = 0
    with pq.ParquetWriter(out_path, RESULTS_SCHEMA) as writer:
        for batch in parquet.iter_batches(
            batch_size=INPUT_BATCH_ROWS, columns=["custom_id"] if has_custom_id else []
        ):
            stop = start + batch.num_rows
            custom_ids = batch.column("custom_id").to_pylist() if has_custom_id else None
            stored = results_between(session, job_id=job.id, start=start, stop=stop)
            out: dict[str, list] = {name: [] for name in RESULT_COLUMNS}
            for offset in range(batch.num_rows):
                index = start + offset
                row = stored.get(index)
                if row is not None:
                    for name in RESULT_COLUMNS:
                        out[name].append(getattr(row, name))
                    continue
                out["row_index"].append(index)
                out["custom_id"].append(custom_ids[offset] if custom_ids else str(index))
                out["output_text"].append("")
                out["prompt_tokens"].append(0)
                out["output_tokens"].append(0)
                out["finish_reason"].append(missing_reason.value)
                out["error"].append(missing_error)
            writer.write_table(pa.table(out, schema=RESULTS_SCHEMA))
            start = stop
    return start
