"""The one shape of a result row (storage.result_record.ResultRecord): the results table and the
results Parquet hold exactly its fields."""

from __future__ import annotations

import typing
from dataclasses import fields

from jobs.domain.results import RESULTS_SCHEMA
from storage.models import ResultRow
from storage.result_record import RESULT_COLUMNS, ResultRecord
from storage.status import FinishReason


def test_the_results_table_holds_the_record_fields_with_their_nullability() -> None:
    table = ResultRow.__table__
    hints = typing.get_type_hints(ResultRecord)
    assert set(RESULT_COLUMNS) <= set(table.columns.keys())
    assert set(table.columns.keys()) - set(RESULT_COLUMNS) == {"job_id", "shard_index", "finished_at"}
    for item in fields(ResultRecord):
        optional = type(None) in typing.get_args(hints[item.name])
        assert table.columns[item.name].nullable == optional, item.name


def test_the_results_parquet_schema_is_the_record_fields_in_order() -> None:
    assert tuple(RESULTS_SCHEMA.names) == RESULT_COLUMNS


def test_a_failed_record_and_its_stored_form() -> None:
    record = ResultRecord.failed(3, "c3", "no prompt")
    assert record.finish_reason == FinishReason.ERROR.value and record.tokens == 0
    assert record.stored(job_id="j", shard_index=1) == {
        "job_id": "j",
        "shard_index": 1,
        "row_index": 3,
        "custom_id": "c3",
        "output_text": "",
        "prompt_tokens": 0,
        "output_tokens": 0,
        "finish_reason": "error",
        "error": "no prompt",
        "cached": False,
    }
