"""Input validation on real Parquet files: prompt sources, per-row problems, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.errors import InputError
from jobs.domain.prompts import PromptSource
from jobs.domain.schemas import ResolvedParams
from jobs.domain.sharding import cut_shards
from jobs.domain.validation import validate_parquet

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

MAX_LEN = 512


def params(**overrides) -> ResolvedParams:
    values = dict(
        model="m",
        max_tokens=8,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        stop=[],
        template=None,
        prompt_column=None,
        chat=None,
        quantization="int8",
        kv_cache_dtype="int8",
    )
    return ResolvedParams(**{**values, **overrides})


def write(tmp_path: Path, table: pa.Table, **kwargs) -> Path:
    path = tmp_path / "input.parquet"
    pq.write_table(table, path, **kwargs)
    return path


def test_prompt_column_rows_are_streamed_and_measured(tmp_path: Path) -> None:
    prompts = [f"prompt {'x' * i}" for i in range(50)] + ["", "   ", None]
    path = write(tmp_path, pa.table({"prompt": prompts}), row_group_size=7)
    checked = validate_parquet(path, params(), MAX_LEN)
    assert checked.num_rows == 53
    assert checked.source == PromptSource("prompt", ("prompt",), chat=False)
    assert checked.prompt_chars[:50].tolist() == [7 + i for i in range(50)]
    assert checked.prompt_chars[50:].tolist() == [0, 0, 0]  # null and blank: error rows later, not a 4xx
    assert checked.null_or_empty_rows == 3


def test_the_most_output_tokens_counts_each_rows_own_max_tokens(tmp_path: Path) -> None:
    # rows to run: those with a prompt; each at its max_tokens cell, or the job's (8) where the cell is null
    table = pa.table({"prompt": ["a", "b", "", "c", None, "d"], "max_tokens": [5, None, 100, 30, 100, None]})
    checked = validate_parquet(write(tmp_path, table, row_group_size=4), params(), MAX_LEN)
    assert checked.total_max_tokens == 5 + 8 + 30 + 8
    without = validate_parquet(write(tmp_path, table.drop_columns(["max_tokens"])), params(), MAX_LEN)
    assert without.total_max_tokens == 4 * 8


def test_messages_column_sums_message_lengths(tmp_path: Path) -> None:
    messages = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        [{"role": "user", "content": "a"}],
        [],
        None,
    ]
    path = write(tmp_path, pa.table({"messages": messages, "custom_id": ["a", "b", "c", "d"]}))
    checked = validate_parquet(path, params(), MAX_LEN)
    assert checked.source.kind == "messages" and checked.source.chat
    assert checked.prompt_chars.tolist() == [13, 1, 0, 0]


def test_template_names_columns_and_builds_prompts(tmp_path: Path) -> None:
    table = pa.table({"text": ["one", None, "three"], "n": [1, 2, 3]})
    path = write(tmp_path, table)
    template = "Doc {n}: {text}"
    checked = validate_parquet(path, params(template=template), MAX_LEN)
    assert checked.source.columns == ("n", "text") and checked.source.chat
    assert checked.prompt_chars.tolist() == [len(template) + 4, 0, len(template) + 6]
    assert checked.source.build({"text": "one", "n": 1}) == (
        [{"role": "user", "content": "Doc 1: one"}],
        None,
    )
    assert checked.source.build({"text": None, "n": 2}) == (None, "column 'text' is null in this row")


@pytest.mark.parametrize(
    ("table", "overrides", "status", "fragment"),
    [
        (pa.table({"text": ["a"]}), {}, 422, "no prompt"),
        (pa.table({"prompt": [1, 2]}), {}, 422, "expected string"),
        (pa.table({"prompt": pa.array([b"\xff"], pa.binary())}), {}, 422, "expected string"),
        (pa.table({"messages": ["not a list"]}), {}, 422, "list<struct<role: string, content: string>>"),
        (pa.table({"prompt": ["a"]}), {"prompt_column": "body"}, 422, "'body' is not in the file"),
        (pa.table({"text": ["a"]}), {"template": "{missing} and {text}"}, 422, "['missing']"),
        (pa.table({"text": ["a"]}), {"template": "{text.__class__}"}, 422, "must be a column name"),
        (pa.table({"text": ["a"]}), {"template": "no placeholders"}, 422, "names no column"),
        (pa.table({"prompt": ["a", "b", "c"], "custom_id": ["x", "y", "x"]}), {}, 422, "repeated: 'x'"),
        (pa.table({"prompt": ["a", "b"], "custom_id": ["x", None]}), {}, 422, "row 1: custom_id is null"),
        (pa.table({"prompt": ["a", "b"], "custom_id": [1, 2]}), {}, 422, "custom_id"),
        (pa.table({"prompt": ["a", "b"], "max_tokens": [4, 0]}), {}, 422, "row 1: max_tokens is 0"),
        (pa.table({"prompt": ["a"], "max_tokens": [MAX_LEN]}), {}, 422, f"between 1 and {MAX_LEN - 1}"),
        (pa.table({"prompt": ["a"], "max_tokens": [1.5]}), {}, 422, "expected integer"),
        (pa.table({"prompt": ["a", "b"], "temperature": [0.5, -1.0]}), {}, 422, "row 1: temperature"),
        (pa.table({"prompt": ["a"], "top_p": [1.5]}), {}, 422, "top_p"),
        (pa.table({"prompt": pa.array([], pa.string())}), {}, 422, "no rows"),
    ],
)
def test_bad_files_are_refused_with_a_clear_message(
    tmp_path: Path, table: pa.Table, overrides: dict, status: int, fragment: str
) -> None:
    path = write(tmp_path, table)
    with pytest.raises(InputError) as caught:
        validate_parquet(path, params(**overrides), MAX_LEN)
    assert caught.value.status_code == status
    assert fragment in caught.value.message


def test_not_parquet_empty_and_truncated_files(tmp_path: Path) -> None:
    good = write(tmp_path, pa.table({"prompt": ["hello"] * 100}))
    data = good.read_bytes()
    for name, content in [
        ("empty", b""),
        ("text", b"prompt\nhello\n"),
        ("truncated", data[: len(data) // 2]),
    ]:
        path = tmp_path / f"{name}.parquet"
        path.write_bytes(content)
        with pytest.raises(InputError) as caught:
            validate_parquet(path, params(), MAX_LEN)
        assert caught.value.status_code == 400, name


def test_many_duplicates_are_named_and_counted(tmp_path: Path) -> None:
    ids = [f"id{i % 3}" for i in range(12)]
    path = write(tmp_path, pa.table({"prompt": ["p"] * 12, "custom_id": ids}))
    with pytest.raises(InputError, match=r"repeated: .* and 4 more"):
        validate_parquet(path, params(), MAX_LEN)


def test_shards_group_similar_lengths_and_cover_every_row() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 1000, size=103)
    shards = cut_shards(lengths, 10)
    assert [len(shard) for shard in shards] == [10] * 10 + [3]
    assert sorted(i for shard in shards for i in shard) == list(range(103))
    maxima = [lengths[shard].max() for shard in shards]
    minima = [lengths[shard].min() for shard in shards]
    assert all(high <= low for high, low in zip(maxima, minima[1:], strict=False))
