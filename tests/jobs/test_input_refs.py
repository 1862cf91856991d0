"""Inputs by reference without services: which URIs pass FREIGHT_INPUT_ALLOW (and why the rest do not),
and row-group sharding covering every row exactly once. The real S3 path: tests/service/test_input_by_reference.py."""

from __future__ import annotations

import random

import pytest

from jobs.domain.errors import InputError
from jobs.domain.input_refs import check_uris
from jobs.domain.sharding import cut_piece_shards

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

ALLOW = ["s3://data-bucket/teams/docs", "s3://other-bucket"]


def test_uris_outside_the_allow_list_or_malformed_are_refused_before_any_request() -> None:
    assert [location.path for _, location, _ in check_uris(
        ["s3://data-bucket/teams/docs/a.parquet", "s3://data-bucket/teams/docs/", "s3://data-bucket/teams/docs/*.parquet",
         "s3://other-bucket/any/where.parquet"], ALLOW)] == [  # fmt: skip
        "data-bucket/teams/docs/a.parquet",
        "data-bucket/teams/docs",
        "data-bucket/teams/docs/*.parquet",
        "other-bucket/any/where.parquet",
    ]
    refused = {
        "s3://data-bucket/teams/docs-private/a.parquet": (403, "FREIGHT_INPUT_ALLOW"),  # sibling prefix
        "s3://data-bucket/teams/a.parquet": (403, "FREIGHT_INPUT_ALLOW"),
        "s3://data-bucket/teams/docs*": (403, "FREIGHT_INPUT_ALLOW"),  # a glob cannot widen the prefix
        "s3://data-bucket/teams/docs/../secrets/a.parquet": (422, "'..'"),
        "s3://data-bucket/teams/docs//a.parquet": (422, "empty"),
        "s3://data-bucket/teams/docs/%2e%2e/a.parquet": (422, "'%'"),
        "s3://data-bucket/teams/docs/a\x00.parquet": (422, "control"),
        "s3://data-bucket/teams/*/a.parquet": (422, "last segment"),
        "s3://user:pw@data-bucket/teams/docs/a.parquet": (422, "bucket name"),
        "s3://data-bucket:9000/teams/docs/a.parquet": (422, "bucket name"),
        "S3://data-bucket/teams/docs/a.parquet": (422, "only s3://"),
        "file:///etc/passwd": (422, "only s3://"),
        "http://169.254.169.254/latest/meta-data/": (422, "only s3://"),
        "/local/file.parquet": (422, "no scheme"),
    }
    for uri, (status, words) in refused.items():
        with pytest.raises(InputError) as caught:
            check_uris([uri], ALLOW)
        assert caught.value.status_code == status and words in caught.value.message, (uri, caught.value.message)
        assert caught.value.field == "input_uris"
    with pytest.raises(InputError) as disabled:
        check_uris(["s3://data-bucket/teams/docs/a.parquet"], [])
    assert disabled.value.status_code == 403 and "disabled" in disabled.value.message


def test_row_group_shards_cover_every_row_once() -> None:
    rng = random.Random(7)
    for _ in range(200):
        files = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        shard_size = rng.randint(1, 12)
        shards = cut_piece_shards(files, shard_size)
        rows = [index for shard in shards for piece in shard for index in range(*piece["rows"])]
        assert rows == list(range(sum(map(sum, files))))
        assert all(sum(p["rows"][1] - p["rows"][0] for p in shard) == shard_size for shard in shards[:-1])
        for shard in shards:
            for piece in shard:  # the piece's rows are its row groups' rows, less `skip` at the start
                groups = files[piece["file"]][slice(*piece["row_groups"])]
                taken = piece["rows"][1] - piece["rows"][0]
                assert 0 <= piece["skip"] < groups[0] and taken <= sum(groups) - piece["skip"]
                assert taken > sum(groups[:-1]) - piece["skip"]  # no row group read for nothing


def test_rows_by_reference_read_only_their_row_groups(tmp_path, monkeypatch) -> None:
    """Rows of a shard come from the row groups that hold them (and only the files they are in), and a
    file whose row groups changed after submission is refused rather than read at the wrong rows."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from storage.input_set import InputChanged, InputFile, InputSet, iter_input_rows

    for name, start, rows in (("a", 0, 7), ("b", 7, 5)):
        ids = [f"r{i}" for i in range(start, start + rows)]
        pq.write_table(pa.table({"custom_id": ids}), tmp_path / f"{name}.parquet", row_group_size=3)
    files = tuple(InputFile(f"s3://b{tmp_path}/{n}.parquet", 0, g) for n, g in (("a", (3, 3, 1)), ("b", (3, 2))))
    inputs = InputSet(files, pafs.LocalFileSystem())
    # local files stand in for objects: the path of s3://b/tmp/... is /tmp/...
    monkeypatch.setattr(InputFile, "path", property(lambda f: f.uri.removeprefix("s3://b")))
    reads: list[tuple[str, int]] = []
    real = pq.ParquetFile.read_row_group

    def recorded(self, group, **kwargs):
        reads.append((self.reader.metadata.num_rows, group))
        return real(self, group, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", recorded)
    rows = dict(iter_input_rows(inputs, [6, 4, 7, 11], ["custom_id"]))
    assert rows == {4: {"custom_id": "r4"}, 6: {"custom_id": "r6"}, 7: {"custom_id": "r7"}, 11: {"custom_id": "r11"}}
    assert reads == [(7, 1), (7, 2), (5, 0), (5, 1)]  # (file rows, group): never group 0 of the first file
    pq.write_table(pa.table({"custom_id": ["x"] * 7}), tmp_path / "a.parquet", row_group_size=4)
    with pytest.raises(InputChanged, match="a.parquet changed"):
        dict(iter_input_rows(inputs, [0], ["custom_id"]))
