"""Inputs by reference: which `s3://` URIs a job may name, and the Parquet files they stand for.

The operator lists what may be read (`FREIGHT_INPUT_ALLOW`, `s3://bucket/prefix` entries); a URI must be
under one of them, segment by segment (`s3://b/docs` allows `s3://b/docs/x.parquet`, not
`s3://b/docs-private/x.parquet`). Anything else is refused before any request is made: other schemes
(file://, http://: no server-side request forgery), `.`/`..`/empty segments, percent-escapes, control
characters, a bucket name with a port or credentials in it. A URI is one object, a folder (`.../`, every
`*.parquet` under it), or a glob in its last segment (`.../docs/*.parquet`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs.domain.errors import InputError, clip_repr
from jobs.domain.grammar_check import GrammarRefusal
from jobs.domain.input_uris import GLOB, S3Location, parse_allow_list, parse_s3_uri
from jobs.domain.schemas import ResolvedParams
from jobs.domain.sharding import cut_piece_shards
from jobs.domain.validation import ValidatedInput, duplicate_ids_error, validate_parquet
from storage.arrow_path import parquet_file, read_schema
from storage.input_set import InputFile, InputSet

MAX_INPUT_URIS = 100
MAX_INPUT_FILES = 10_000
FIELD = "input_uris"


def _refuse(uri: str, problem: str, status_code: int = 422) -> InputError:
    return InputError(f"input {clip_repr(uri, 300)}: {problem}", status_code=status_code, field=FIELD)


def check_uris(uris: Sequence[str], allow: Sequence[str]) -> list[tuple[str, S3Location, bool]]:
    """Each URI parsed and checked against the allow list, before anything is read."""
    if not allow:
        raise InputError(
            "inputs by reference are disabled on this service (FREIGHT_INPUT_ALLOW is empty): upload the file",
            status_code=403,
            field=FIELD,
        )
    if not uris:
        raise InputError("name at least one input URI", field=FIELD)
    if len(uris) > MAX_INPUT_URIS:
        raise InputError(f"{len(uris)} input URIs; at most {MAX_INPUT_URIS} are taken", field=FIELD)
    allowed = parse_allow_list(allow)
    checked = []
    for uri in uris:
        try:
            location, is_folder = parse_s3_uri(uri, globs=True)
        except ValueError as exc:
            raise _refuse(uri, str(exc)) from None
        if not any(location.under(entry) for entry in allowed):
            raise _refuse(uri, "not under a prefix this service may read (FREIGHT_INPUT_ALLOW)", 403)
        checked.append((uri, location, is_folder))
    return checked


def _list(filesystem: pafs.FileSystem, folder: S3Location, recursive: bool) -> list[pafs.FileInfo]:
    selector = pafs.FileSelector(folder.path, recursive=recursive, allow_not_found=True)
    return sorted(
        (info for info in filesystem.get_file_info(selector) if info.type == pafs.FileType.File),
        key=lambda info: info.path,
    )


def _expand(filesystem: pafs.FileSystem, uri: str, location: S3Location, is_folder: bool) -> list[pafs.FileInfo]:
    """The objects a checked URI names: itself, the Parquet files of its folder, or its glob's matches."""
    name = location.key.rsplit("/", 1)[-1]
    if GLOB.search(name):
        parent = S3Location(location.bucket, location.key.rpartition("/")[0])
        found = [info for info in _list(filesystem, parent, False) if fnmatch.fnmatchcase(info.base_name, name)]
        what = "no object matches the glob"
    else:
        info = filesystem.get_file_info(location.path) if location.key else None
        if info is not None and info.type == pafs.FileType.File and not is_folder:
            return [info]
        found = [info for info in _list(filesystem, location, True) if info.path.endswith(".parquet")]
        what = "no such object, and no .parquet object under it"
    if not found:
        raise _refuse(uri, what, 400)
    return found


def _group_rows(filesystem: pafs.FileSystem, uri: str, info: pafs.FileInfo) -> tuple[int, ...]:
    """Rows per row group, from the file's footer (a ranged read of its tail)."""
    if info.size == 0:
        raise _refuse(uri, "the file is empty", 400)
    try:
        metadata = pq.ParquetFile(info.path, filesystem=filesystem).metadata
    except (pa.ArrowException, OSError) as exc:
        raise _refuse(uri, f"not a readable Parquet file: {exc}", 400) from exc
    return tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))


def _allowed(file_uri: str, allowed: Sequence[S3Location]) -> bool:
    try:
        location = parse_s3_uri(file_uri, globs=True)[0]
    except ValueError:  # a listed key with characters a URI may not hold
        return False
    return any(location.under(entry) for entry in allowed)


def reference_input(uris: Sequence[str], allow: Sequence[str], filesystem: pafs.FileSystem) -> InputSet:
    """The files the URIs name, in the order named (a folder's or glob's in key order), with their row
    groups; a 4xx naming the URI when one is not allowed, missing, or not Parquet."""
    allowed = parse_allow_list(allow) if allow else []
    files: list[InputFile] = []
    seen: set[str] = set()
    for uri, location, is_folder in check_uris(uris, allow):
        try:
            matches = _expand(filesystem, uri, location, is_folder)
        except OSError as exc:  # access denied, an unreachable endpoint: say which URI
            raise _refuse(uri, f"cannot be read: {exc}", 400) from exc
        for info in matches:
            file_uri = f"s3://{info.path}"
            # A listing returns keys only under the checked prefix; checked again all the same.
            if not _allowed(file_uri, allowed):
                raise _refuse(file_uri, "not under a prefix this service may read (FREIGHT_INPUT_ALLOW)", 403)
            if file_uri in seen:
                raise _refuse(file_uri, "named twice (each file is read once)")
            seen.add(file_uri)
            if len(seen) > MAX_INPUT_FILES:
                raise _refuse(uri, f"more than {MAX_INPUT_FILES} files in one job")
            try:
                group_rows = _group_rows(filesystem, file_uri, info)
            except OSError as exc:
                raise _refuse(file_uri, f"cannot be read: {exc}", 400) from exc
            files.append(InputFile(file_uri, info.size, group_rows))
    return InputSet(tuple(files), filesystem)


def _check_unique_ids(inputs: InputSet, id_hashes: list[np.ndarray]) -> None:
    """custom_id unique over every file: the ids' hashes sorted find the few that may repeat, and only
    those ids are compared, in a second pass over the custom_id column (a hash collision is no error)."""
    hashes = np.concatenate(id_hashes)
    id_hashes.clear()  # before sorting, in place: at most two copies of the hashes at once
    hashes.sort()
    suspects = set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())
    del hashes
    if not suspects:
        return
    counts: dict[str, int] = {}
    for index in range(len(inputs.files)):
        where = inputs.arrow(index)
        for batch in parquet_file(where).iter_batches(batch_size=65_536, columns=["custom_id"]):
            for value in batch.column(0).to_pylist():
                if hash(value) in suspects:
                    counts[value] = counts.get(value, 0) + 1
    duplicates = [value for value, count in counts.items() if count > 1]
    if duplicates:
        raise duplicate_ids_error(duplicates)


@dataclass(frozen=True)
class CheckedReference:
    """An input by reference that passed every check of a submission, and its shards."""

    inputs: InputSet
    validated: ValidatedInput  # every file's counts summed (no per-row lengths: prompt_chars is empty)
    pieces: list[list[dict]]  # per shard, its row-group ranges (sharding.cut_piece_shards)

    @property
    def num_rows(self) -> int:
        return self.validated.num_rows


def _in_file(exc: InputError, uri: str) -> InputError:
    """The file's own error (a row number counts from the file's first row), naming the file."""
    return InputError(
        f"input {clip_repr(uri, 300)}: {exc.message}",
        status_code=exc.status_code,
        row=exc.row,
        column=exc.column,
        field=exc.field or (FIELD if exc.column is None else None),
        code=exc.code,
    )


def check_reference(
    uris: Sequence[str],
    resolved: ResolvedParams,
    context_len: int,
    grammar: GrammarRefusal | None,
    *,
    allow: Sequence[str],
    filesystem: pafs.FileSystem,
    shard_size: int,
) -> CheckedReference:
    """The submission's checks of an input by reference, in place: the URIs, then each file's footer and
    its rows row group by row group (the upload's checks, validation.py); nothing is copied. The files must
    have the same columns; custom_ids are unique over all of them."""
    if resolved.summarize is not None:
        raise InputError("a summarize job takes an uploaded file, not an input by reference", field=FIELD)
    inputs = reference_input(uris, allow, filesystem)
    first: pa.Schema | None = None
    id_hashes: list[np.ndarray] = []
    total: ValidatedInput | None = None
    for index, item in enumerate(inputs.files):
        where = inputs.arrow(index)
        try:
            schema = read_schema(where)
            if first is not None and not schema.equals(first, check_metadata=False):
                raise InputError(f"its columns differ from those of {clip_repr(inputs.files[0].uri, 300)}")
            first = first or schema
            validated = validate_parquet(
                where, resolved, context_len, grammar, id_hashes=id_hashes, keep_prompt_chars=False
            )
        except InputError as exc:
            raise _in_file(exc, item.uri) from exc
        except (pa.ArrowException, OSError) as exc:
            raise _refuse(item.uri, f"cannot be read: {exc}", 400) from exc
        total = validated if total is None else _summed(total, validated)
    if id_hashes:
        try:
            _check_unique_ids(inputs, id_hashes)
        except InputError as exc:
            raise _in_file(exc, " ".join(uris)) from exc
    assert total is not None  # reference_input refuses a URI that names no file
    pieces = cut_piece_shards([item.group_rows for item in inputs.files], shard_size)
    return CheckedReference(inputs, total, pieces)


def _summed(total: ValidatedInput, more: ValidatedInput) -> ValidatedInput:
    """The counts of two files read one after the other (same columns: same prompt source)."""
    return replace(
        total,
        num_rows=total.num_rows + more.num_rows,
        null_or_empty_rows=total.null_or_empty_rows + more.null_or_empty_rows,
        total_prompt_chars=total.total_prompt_chars + more.total_prompt_chars,
        total_max_tokens=total.total_max_tokens + more.total_max_tokens,
    )
