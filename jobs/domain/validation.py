"""Validate an input Parquet file: its schema from the footer, then its rows one row group (batch) at a
time, so memory stays bounded by the batch and one small integer per row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.domain.errors import InputError, clip_repr
from jobs.domain.grammar_check import GrammarRefusal
from jobs.domain.prompts import PromptSource, is_string_type, resolve_source
from jobs.domain.schemas import MAX_SEED, MAX_TEMPERATURE, OVERRIDE_COLUMNS, ResolvedParams
from jobs.domain.structured_spec import check_column_types, check_column_values
from jobs.domain.text_rule import check_arrow_text
from storage.arrow_path import ParquetSource, file_size, parquet_file

BATCH_ROWS = 8192
MAX_NAMED_DUPLICATES = 5
MAX_CUSTOM_ID_CHARS = 1024


@dataclass
class ValidatedInput:
    num_rows: int
    prompt_chars: np.ndarray  # [num_rows] int64: characters in each row's prompt, for sharding
    source: PromptSource
    null_or_empty_rows: int  # these become error rows, not a failed job
    override_columns: tuple[str, ...]
    total_prompt_chars: int  # prompt_chars summed, kept even when prompt_chars is not (quotes price it)
    # the most output tokens the rows to run may take: each one's max_tokens cell, or the job's where the
    # column is absent or the cell null (the quote's output_tokens_max)
    total_max_tokens: int


def open_parquet(source: ParquetSource) -> pq.ParquetFile:
    if file_size(source) == 0:
        raise InputError("the file is empty", status_code=400)
    try:
        parquet = parquet_file(source)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"not a readable Parquet file: {exc}", status_code=400) from exc
    check_unique_columns(parquet.schema_arrow)
    return parquet


def check_unique_columns(schema: pa.Schema) -> None:
    """Two columns of one name make every use of that name ambiguous: refuse the file."""
    seen: set[str] = set()
    for name in schema.names:
        if name in seen:
            count = schema.names.count(name)
            raise InputError(
                f"column {clip_repr(name)} appears {count} times; column names must be unique",
                column=name[:100],
            )
        seen.add(name)


def validate_parquet(
    where: ParquetSource,
    params: ResolvedParams,
    max_model_len: int,
    grammar: GrammarRefusal | None = None,  # the submission's grammar check (grammar_check.py)
    *,
    # An input by reference: each batch's custom_id hashes go here, and the caller finds duplicates over
    # all the files (input_refs.py), in 8 bytes a row rather than a set of the ids themselves.
    id_hashes: list[np.ndarray] | None = None,
    keep_prompt_chars: bool = True,  # False: sharding needs no row lengths (an input by reference)
) -> ValidatedInput:
    parquet = open_parquet(where)
    schema = parquet.schema_arrow
    source = resolve_source(schema, params.template, params.prompt_column, params.chat)
    if parquet.metadata.num_rows == 0:
        raise InputError("the file has no rows", status_code=422)
    overrides = tuple(name for name in OVERRIDE_COLUMNS if name in schema.names)
    for name in overrides:
        _check_override_type(name, schema.field(name).type)
    has_custom_id = "custom_id" in schema.names
    if has_custom_id and not is_string_type(schema.field("custom_id").type):
        raise InputError(
            f"column 'custom_id' has type {schema.field('custom_id').type}; expected string",
            column="custom_id",
        )

    structured = check_column_types(schema)  # json_schema / regex / choice row columns
    id_column = params.summarize.id_column if params.summarize is not None else None
    columns = list(
        dict.fromkeys([
            *source.columns, *overrides, *structured, *(["custom_id"] if has_custom_id else []),
            *([id_column] if id_column in schema.names else []),
        ])
    )  # fmt: skip
    # The text rule (text_rule.py): every string cell read is valid UTF-8; ids, which are stored, hold no NUL.
    text_columns = {name: True for name in (*source.columns, *structured)}
    text_columns.update({name: False for name in ("custom_id", id_column) if name in columns})
    lengths: list[np.ndarray] = []
    seen_ids: set[str] = set()
    duplicates: list[str] = []
    empty_rows = 0
    total_chars = 0
    total_max_tokens = 0
    offset = 0
    try:
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            batch = _decoded(batch)
            for name, allow_nul in text_columns.items():
                check_arrow_text(batch.column(name), name, offset, allow_nul=allow_nul)
            chars = _prompt_chars(batch, source)
            empty_rows += int(np.count_nonzero(chars == 0))
            total_chars += int(chars.sum())
            total_max_tokens += _max_tokens_to_run(batch, chars, params.max_tokens)
            if keep_prompt_chars:
                lengths.append(chars)
            for name in overrides:
                _check_override_values(name, batch.column(name), offset, params, max_model_len)
            check_column_values(batch, structured, offset, grammar)
            if has_custom_id:
                _check_custom_ids(batch.column("custom_id"), offset, seen_ids, duplicates, id_hashes)
            offset += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"could not read the Parquet data near row {offset}: {exc}", status_code=400
        ) from exc
    if duplicates:
        raise duplicate_ids_error(duplicates)
    return ValidatedInput(
        num_rows=offset,
        prompt_chars=np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64),
        source=source,
        null_or_empty_rows=empty_rows,
        override_columns=overrides,
        total_prompt_chars=total_chars,
        total_max_tokens=total_max_tokens,
    )


def _max_tokens_to_run(batch: pa.RecordBatch, chars: np.ndarray, default: int) -> int:
    """The batch's rows to run (a prompt of at least one character), each at its own max_tokens cell where the
    file has that column (read with the overrides) and the cell is set, else at the job's."""
    to_run = chars > 0
    if "max_tokens" not in batch.schema.names:
        return int(np.count_nonzero(to_run)) * default
    cells = pc.fill_null(batch.column("max_tokens"), default).to_numpy(zero_copy_only=False)
    return int(cells[to_run].astype(np.int64).sum())


def _decoded(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with dictionary-encoded columns (how pyarrow and Spark often write strings) as plain ones,
    so every check below sees values, not indices."""
    if not any(pa.types.is_dictionary(field.type) for field in batch.schema):
        return batch
    arrays = [
        column.dictionary_decode() if pa.types.is_dictionary(column.type) else column for column in batch.columns
    ]
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def _prompt_chars(batch: pa.RecordBatch, source: PromptSource) -> np.ndarray:
    """[batch rows] int64 characters per prompt; 0 for null or empty."""
    if source.kind == "messages":
        column = batch.column(source.columns[0])
        flat = pc.list_flatten(column)
        content_chars = pc.fill_null(pc.utf8_length(pc.struct_field(flat, "content")), 0)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        return np.bincount(
            parents, weights=content_chars.to_numpy(zero_copy_only=False), minlength=batch.num_rows
        ).astype(np.int64)
    if source.kind == "template":
        total = np.full(batch.num_rows, len(source.template or ""), dtype=np.int64)
        any_null = np.zeros(batch.num_rows, dtype=bool)
        for name in source.columns:
            chars = pc.utf8_length(pc.cast(batch.column(name), pa.string()))
            any_null |= pc.is_null(chars).to_numpy(zero_copy_only=False)
            total += pc.fill_null(chars, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return np.where(any_null, 0, total)
    text = batch.column(source.columns[0])
    stripped = pc.utf8_trim_whitespace(text)
    chars = pc.utf8_length(text).to_numpy(zero_copy_only=False)
    empty = pc.fill_null(pc.equal(pc.utf8_length(stripped), 0), True).to_numpy(zero_copy_only=False)
    return np.where(empty, 0, np.nan_to_num(chars, nan=0)).astype(np.int64)


def _check_override_type(name: str, arrow_type: pa.DataType) -> None:
    numeric = pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
    if name in ("max_tokens", "seed"):
        numeric = pa.types.is_integer(arrow_type)
    if not numeric:
        expected = "integer" if name in ("max_tokens", "seed") else "number"
        raise InputError(f"column {name!r} has type {arrow_type}; expected {expected}", column=name)


def _check_override_values(
    name: str, column: pa.Array, offset: int, params: ResolvedParams, max_model_len: int
) -> None:
    values = column.to_numpy(zero_copy_only=False)
    valid = ~pc.is_null(column).to_numpy(zero_copy_only=False)
    if name == "max_tokens":
        bad = valid & ((values < 1) | (values >= max_model_len))
        limit = f"between 1 and {max_model_len - 1}"
    elif name == "temperature":
        bad = valid & ~((values >= 0) & (values <= MAX_TEMPERATURE))
        limit = f"between 0 and {MAX_TEMPERATURE:g}"
    elif name == "top_p":
        bad = valid & ~((values > 0) & (values <= 1))
        limit = "in (0, 1]"
    elif name == "seed":
        # Compared as Python ints: a uint64 2^64 - 1 or an int64 -5 is out of range either way.
        bad = np.array([value is not None and not 0 <= int(value) <= MAX_SEED for value in column.to_pylist()])
        limit = f"between 0 and {MAX_SEED}"
    else:
        return
    if bad.any():
        row = offset + int(np.argmax(bad))
        raise InputError(
            f"row {row}: {name} is {values[row - offset]}; it must be {limit}", row=row, column=name
        )


def duplicate_ids_error(duplicates: list[str]) -> InputError:
    named = ", ".join(repr(value) for value in duplicates[:MAX_NAMED_DUPLICATES])
    more = (
        f" and {len(duplicates) - MAX_NAMED_DUPLICATES} more" if len(duplicates) > MAX_NAMED_DUPLICATES else ""
    )
    return InputError(f"custom_id must be unique; repeated: {named}{more}", column="custom_id")


def _check_custom_ids(
    column: pa.Array, offset: int, seen: set[str], duplicates: list[str], hashes: list[np.ndarray] | None
) -> None:
    if column.null_count:
        row = offset + int(np.argmax(pc.is_null(column).to_numpy(zero_copy_only=False)))
        raise InputError(f"row {row}: custom_id is null", row=row, column="custom_id")
    long_ids = pc.utf8_length(column).to_numpy(zero_copy_only=False) > MAX_CUSTOM_ID_CHARS
    if long_ids.any():
        row = offset + int(np.argmax(long_ids))
        raise InputError(
            f"row {row}: custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters",
            row=row,
            column="custom_id",
        )
    if hashes is not None:
        values = column.to_pylist()
        hashes.append(np.fromiter(map(hash, values), dtype=np.int64, count=len(values)))
        return
    for value in column.to_pylist():
        if value in seen:
            duplicates.append(value)
        else:
            seen.add(value)
