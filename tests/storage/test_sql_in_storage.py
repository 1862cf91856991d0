"""All SQL lives in storage/: jobs/ and worker/ call storage functions and build no queries (checked
statically). The one exception is the API's readiness probe (`SELECT 1` on a raw connection)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from storage.db import chunked

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

ROOT = Path(__file__).resolve().parents[2]
QUERY_BUILDERS = {"select", "insert", "update", "delete", "func", "text", "or_", "and_", "distinct"}
ALLOWED = {("jobs/api/app.py", "text")}  # the readiness probe: SELECT 1 on a raw connection


def test_jobs_and_worker_build_no_queries() -> None:
    offenders = []
    for package in ("jobs", "worker"):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where.startswith("worker/engine/"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
                    for alias in node.names:
                        if alias.name in QUERY_BUILDERS and (where, alias.name) not in ALLOWED:
                            offenders.append(f"{where}:{node.lineno}: imports {node.module}.{alias.name}")
                if isinstance(node, ast.Attribute) and node.attr == "query":
                    offenders.append(f"{where}:{node.lineno}: .query")
    assert not offenders, "SQL outside storage/ (move it into a storage function):\n  " + "\n  ".join(
        offenders
    )


def test_chunked_splits_in_lists() -> None:
    assert list(chunked([1, 2, 3, 4, 5], size=2)) == [[1, 2], [3, 4], [5]]
    assert list(chunked([], size=2)) == []
    assert [len(chunk) for chunk in chunked(range(2500))] == [1000, 1000, 500]
