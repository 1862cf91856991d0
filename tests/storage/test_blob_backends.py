"""The job-file store (storage/blobs.py) on both backends, the same cases each: a local folder and a real
S3 server (SeaweedFS, tests/s3_server.py). Writers are atomic (a failed or unfinished write shows
nothing, and leaves an earlier version whole), readers stream, names are the server's own."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from jobs.domain.settings import Settings, blob_store
from storage.arrow_path import ArrowPath, file_size, parquet_file, read_schema
from storage.blobs import BlobStore, NoLocalPath, UploadTooLarge, input_name, staging_name
from storage.storage_url import StorageLocation, parse_storage_url
from tests.s3_server import S3Server
from worker.inputs import read_rows

# Above pyarrow's S3 part size (10 MiB): the upload is a multipart one.
LARGE_BYTES = 12 * 1024 * 1024


class WriterFailed(Exception):
    pass


def test_text_round_trip(each_store: BlobStore) -> None:
    each_store.write_text("jobs/j1/metrics.json", '{"rows": 3}')
    assert each_store.exists("jobs/j1/metrics.json")
    assert each_store.size("jobs/j1/metrics.json") == 11
    assert each_store.read_text("jobs/j1/metrics.json") == '{"rows": 3}'
    assert not each_store.exists("jobs/j1/other.json")
    with pytest.raises(FileNotFoundError):
        each_store.size("jobs/j1/other.json")
    with pytest.raises(FileNotFoundError):
        each_store.open_input("jobs/j1/other.json")


def test_a_failed_write_leaves_no_object(each_store: BlobStore) -> None:
    with pytest.raises(WriterFailed), each_store.open_output("jobs/j1/results.parquet") as sink:
        sink.write(os.urandom(LARGE_BYTES))
        raise WriterFailed
    assert not each_store.exists("jobs/j1/results.parquet")
    assert each_store.list("jobs") == []
    assert _spooled(each_store) == []


def test_a_failed_overwrite_keeps_the_old_version(each_store: BlobStore) -> None:
    each_store.write_text("jobs/j1/metrics.json", "old")
    with pytest.raises(WriterFailed), each_store.open_output("jobs/j1/metrics.json") as sink:
        sink.write(b"half of the new")
        raise WriterFailed
    assert each_store.read_text("jobs/j1/metrics.json") == "old"


def test_a_write_in_progress_is_not_visible(each_store: BlobStore) -> None:
    with each_store.open_output("jobs/j1/input.parquet") as sink:
        sink.write(b"x" * 1000)
        assert not each_store.exists("jobs/j1/input.parquet")
        assert each_store.list("jobs/j1") == []
    assert each_store.list("jobs/j1") == ["jobs/j1/input.parquet"]


# A writer process: spools `size` bytes into `name` through write_stream, as the API stores an upload.
WRITER = """
import io, os, sys
from pathlib import Path
from storage.blobs import BlobStore
url, endpoint, spool, name, size = sys.argv[1:]
store = BlobStore.from_url(url, endpoint_url=endpoint or None, spool_dir=Path(spool))
print("started", flush=True)
store.write_stream(name, io.BytesIO(os.urandom(int(size))), max_bytes=int(size))
print("done", flush=True)
"""


@pytest.mark.parametrize("kill_after_s", [0.3, 0.9, 1.5])
def test_a_writer_killed_at_any_moment_leaves_nothing_or_everything(
    each_store: BlobStore, request: pytest.FixtureRequest, tmp_path: Path, kill_after_s: float
) -> None:
    """SIGKILL while the writer spools or uploads (a 3-part multipart upload on S3): the name shows
    nothing or the whole file, never a part."""
    endpoint = "" if each_store.is_local else request.getfixturevalue("s3_server").endpoint_url
    size = 3 * LARGE_BYTES
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WRITER,
            each_store.url,
            endpoint,
            str(tmp_path / "spool"),
            input_name("j1"),
            str(size),
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert writer.stdout is not None and writer.stdout.readline() == b"started\n"
    time.sleep(kill_after_s)
    writer.kill()
    writer.wait()
    assert not each_store.exists(input_name("j1")) or each_store.size(input_name("j1")) == size
    assert each_store.list("jobs") in ([], [input_name("j1")])


def test_an_upload_over_the_limit_leaves_no_object(each_store: BlobStore) -> None:
    with pytest.raises(UploadTooLarge):
        each_store.write_stream(staging_name("j1"), io.BytesIO(b"x" * 5000), max_bytes=4096, chunk_bytes=1024)
    assert not each_store.exists(staging_name("j1"))
    assert each_store.write_stream(staging_name("j1"), io.BytesIO(b"x" * 4096), max_bytes=4096) == 4096
    assert each_store.size(staging_name("j1")) == 4096


def test_a_large_file_streams_back_in_chunks(each_store: BlobStore) -> None:
    data = os.urandom(LARGE_BYTES)
    written = each_store.write_stream("jobs/j1/input.parquet", io.BytesIO(data), max_bytes=LARGE_BYTES)
    assert written == LARGE_BYTES == each_store.size("jobs/j1/input.parquet")
    digest, chunks = hashlib.sha256(), 0
    with each_store.open_input("jobs/j1/input.parquet") as source:
        while chunk := source.read(1 << 20):
            assert len(chunk) <= 1 << 20
            digest.update(chunk)
            chunks += 1
    assert chunks == 12
    assert digest.digest() == hashlib.sha256(data).digest()
    assert _spooled(each_store) == []


def test_list_names_the_files_under_a_prefix(each_store: BlobStore) -> None:
    for name in (
        "jobs/j2/results.parquet",
        "jobs/j1/input.parquet",
        "jobs/j1/parts/0.parquet",
        "staging/j3.parquet",
    ):
        each_store.write_text(name, "x")
    assert each_store.list("jobs") == [
        "jobs/j1/input.parquet",
        "jobs/j1/parts/0.parquet",
        "jobs/j2/results.parquet",
    ]
    assert each_store.list("jobs/j1/parts") == ["jobs/j1/parts/0.parquet"]
    assert each_store.list("staging") == ["staging/j3.parquet"]
    assert each_store.list("nothing") == []


def test_delete_and_delete_job(each_store: BlobStore) -> None:
    for name in (
        "jobs/j1/input.parquet",
        "jobs/j1/parts/0.parquet",
        "jobs/j2/input.parquet",
        "staging/j1.parquet",
    ):
        each_store.write_text(name, "x")
    each_store.delete("staging/j1.parquet")
    each_store.delete("staging/j1.parquet")  # nothing to delete is fine
    each_store.delete_job("j1")
    each_store.delete_job("j1")
    each_store.delete_job("never")
    assert each_store.list("jobs") == ["jobs/j2/input.parquet"]
    assert each_store.list("staging") == []


def test_rename_moves_a_staged_upload(each_store: BlobStore) -> None:
    each_store.write_text(staging_name("j1"), "validated")
    each_store.rename(staging_name("j1"), input_name("j1"))
    assert not each_store.exists(staging_name("j1"))
    assert each_store.read_text(input_name("j1")) == "validated"


def test_stale_finds_files_by_age(each_store: BlobStore) -> None:
    each_store.write_text("staging/j1.parquet", "x")
    each_store.write_text("staging/deeper/j2.parquet", "x")
    assert each_store.stale("staging", older_than_s=3600) == []
    assert each_store.stale("staging", older_than_s=-3600) == ["staging/j1.parquet"]  # not recursive
    assert each_store.stale("nothing", older_than_s=-3600) == []


@pytest.mark.parametrize(
    "name",
    [
        "../escape",
        "/abs/path",
        "jobs//x",
        "jobs/./x",
        "jobs/../x",
        "",
        "jobs/x/",
        "jobs/ü",
        "a b",
        "x\x00",
        "jobs/x\n",
    ],
)
def test_names_outside_the_servers_shape_are_refused(each_store: BlobStore, name: str) -> None:
    for use in (
        each_store.exists,
        each_store.open_input,
        each_store.delete,
        each_store.list,
        each_store.arrow,
        lambda n: each_store.write_text(n, "x"),
        lambda n: each_store.rename("staging/ok.parquet", n),
    ):
        with pytest.raises(ValueError, match="invalid blob name"):
            use(name)
    assert each_store.list("jobs") == [] and each_store.list("staging") == []


def test_parquet_round_trip_through_filesystem_and_path(each_store: BlobStore) -> None:
    """Written through the atomic sink; read by pyarrow.parquet through (filesystem, path), one row group
    at a time, as validation and the workers read inputs."""
    table = pa.table(
        {"custom_id": [f"r{i}" for i in range(1000)], "prompt": [f"say {i}" for i in range(1000)]}
    )
    with each_store.open_output(input_name("j1")) as sink:
        pq.write_table(table, sink, row_group_size=100)
    where = each_store.arrow(input_name("j1"))
    assert isinstance(where, ArrowPath) and isinstance(where.filesystem, pafs.FileSystem)
    parquet = pq.ParquetFile(where.path, filesystem=where.filesystem)
    assert parquet.metadata.num_rows == 1000 and parquet.metadata.num_row_groups == 10
    assert parquet.read_row_group(3).column("custom_id")[0].as_py() == "r300"
    assert read_schema(where) == table.schema
    assert file_size(where) == each_store.size(input_name("j1"))
    assert parquet_file(where).read().equals(table)
    rows = read_rows(where, [5, 998, 301], ["custom_id"])
    assert rows == {5: {"custom_id": "r5"}, 301: {"custom_id": "r301"}, 998: {"custom_id": "r998"}}
    # pyarrow's own writer through the pair also works (it is not atomic: job files use open_output)
    pq.write_table(table.slice(0, 10), where.path, filesystem=where.filesystem)
    assert parquet_file(each_store.arrow(input_name("j1"))).metadata.num_rows == 10


def test_atomic_path_hands_a_local_file_to_path_based_writers(each_store: BlobStore) -> None:
    with each_store.atomic_path("jobs/j1/results.parquet") as temp:
        assert isinstance(temp, Path)
        pq.write_table(pa.table({"a": [1, 2]}), temp)
    assert parquet_file(each_store.arrow("jobs/j1/results.parquet")).read().column("a").to_pylist() == [1, 2]


def test_copy_in(each_store: BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "local.bin"
    source.write_bytes(b"abc" * 1000)
    each_store.copy_in("jobs/j1/input.parquet", source)
    with each_store.open_input("jobs/j1/input.parquet") as stream:
        assert stream.read() == b"abc" * 1000


def test_local_paths_only_on_the_file_backend(each_store: BlobStore) -> None:
    each_store.write_text("jobs/j1/metrics.json", "{}")
    if each_store.is_local:
        assert each_store.path("jobs/j1/metrics.json").read_text() == "{}"
        assert each_store.arrow("jobs/j1/metrics.json").local_path == each_store.path("jobs/j1/metrics.json")
    else:
        with pytest.raises(NoLocalPath):
            each_store.path("jobs/j1/metrics.json")
        assert each_store.arrow("jobs/j1/metrics.json").local_path is None


def test_the_s3_store_writes_under_its_prefix_only(s3_server: S3Server, tmp_path: Path) -> None:
    store = BlobStore.from_url(
        s3_server.url("tenant-a/freight"), endpoint_url=s3_server.endpoint_url, spool_dir=tmp_path
    )
    store.write_text(input_name("j1"), "x")
    admin = s3_server.filesystem()
    found = admin.get_file_info(pafs.FileSelector(f"{s3_server.bucket}/tenant-a", recursive=True))
    files = [info.path for info in found if info.type == pafs.FileType.File]
    assert files == [f"{s3_server.bucket}/tenant-a/freight/jobs/j1/input.parquet"]
    store.delete_job("j1")


def test_the_s3_store_needs_the_right_credentials(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials come from the standard AWS_* environment; the server checks them."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = BlobStore.from_url(
        s3_server.url("denied"), endpoint_url=s3_server.endpoint_url, spool_dir=tmp_path
    )
    with pytest.raises(OSError, match="(?i)access_?denied|signature_?does_?not_?match"):
        store.write_text("jobs/j1/metrics.json", "{}")
    assert list(tmp_path.iterdir()) == []  # the spooled file went with the failed upload


@pytest.mark.parametrize(
    ("url", "location"),
    [
        ("file:///srv/freight/data", StorageLocation("file", "/srv/freight/data")),
        ("file:///srv/freight/data/", StorageLocation("file", "/srv/freight/data")),
        ("s3://bucket", StorageLocation("s3", "bucket")),
        ("s3://bucket/a/b/", StorageLocation("s3", "bucket/a/b")),
    ],
)
def test_storage_urls(url: str, location: StorageLocation) -> None:
    assert parse_storage_url(url) == location


@pytest.mark.parametrize(
    "url",
    [
        "/srv/data",
        "gs://bucket/x",
        "file://host/srv",
        "file:relative",
        "s3:///prefix",
        "s3://b/a//c",
        "s3://b/../c",
        "s3://b/x?y=1",
    ],
)
def test_other_storage_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="storage URL"):
        parse_storage_url(url)


def _spooled(store: BlobStore) -> list[Path]:
    """What an S3 store's writers left in their spool folder (nothing, once a write has ended)."""
    if store.spool_dir is None or not store.spool_dir.exists():
        return []
    return list(store.spool_dir.iterdir())


def test_settings_default_to_the_data_folder(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", data_dir=tmp_path / "data")
    assert settings.resolved_storage_url == (tmp_path / "data").as_uri()
    store = blob_store(settings)
    assert store.is_local and store.root == tmp_path / "data"
    store.write_text("jobs/j1/metrics.json", "{}")
    assert (tmp_path / "data" / "jobs" / "j1" / "metrics.json").read_text() == "{}"


def test_settings_open_the_s3_store(s3_server: S3Server, tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path / "home",
        data_dir=tmp_path / "scratch",
        storage_url=s3_server.url("from-settings"),
        s3_endpoint_url=s3_server.endpoint_url,
    )
    store = blob_store(settings)
    assert not store.is_local and store.url == s3_server.url("from-settings")
    store.write_text("jobs/j1/metrics.json", "{}")
    assert (
        s3_server.filesystem().get_file_info(f"{s3_server.bucket}/from-settings/jobs/j1/metrics.json").size
        == 2
    )
    assert list((tmp_path / "scratch" / "spool").iterdir()) == []  # the spool, emptied after the upload


@pytest.mark.parametrize(
    "values",
    [{"storage_url": "gs://bucket/x"}, {"storage_url": "/srv/data"}, {"s3_endpoint_url": "127.0.0.1:8333"}],
)
def test_settings_refuse_unknown_stores(values: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        Settings(**values)
