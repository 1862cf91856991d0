"""The one shape of a result row: what every kind of shard writes, what the results table stores
(storage.models.ResultRow holds these columns, checked by tests/storage/test_result_record.py) and
what the results Parquet holds (jobs.domain.results.RESULTS_SCHEMA is built from these fields)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from storage.status import FinishReason


def _column(arrow: str, **options: Any) -> Any:
    """A field with the Arrow type of its Parquet column (a name of a pyarrow type factory)."""
    return field(metadata={"arrow": arrow}, **options)


@dataclass(frozen=True, slots=True)
class ResultRecord:
    row_index: int = _column("int64")
    custom_id: str = _column("string")
    output_text: str = _column("string")
    prompt_tokens: int = _column("int32")
    output_tokens: int = _column("int32")
    finish_reason: str = _column("string")
    error: str | None = _column("string")  # None unless the row failed
    cached: bool = _column("bool_", default=False)  # reused from the tenant's result cache, not run

    @classmethod
    def failed(
        cls, row_index: int, custom_id: str, problem: str, reason: str = FinishReason.ERROR
    ) -> ResultRecord:
        """A row that produced no output: it ran into `problem` (or was never run, say cancelled)."""
        return cls(row_index, custom_id, "", 0, 0, str(reason), problem)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def stored(self, *, job_id: str, shard_index: int) -> dict[str, Any]:
        """The row as storage.result_store.insert_results takes it."""
        return {"job_id": job_id, "shard_index": shard_index, **asdict(self)}


RESULT_COLUMNS: tuple[str, ...] = tuple(item.name for item in fields(ResultRecord))
RESULT_ARROW_TYPES: dict[str, str] = {item.name: item.metadata["arrow"] for item in fields(ResultRecord)}
