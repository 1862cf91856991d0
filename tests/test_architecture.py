"""The layering of the packages, checked statically (Python's ast) over every .py file in jobs/, worker/,
storage/ and kernels/, counting both module-level imports and imports inside functions:

  storage/      the database and blob stores; imports nothing from jobs, worker or kernels
  jobs/domain/  the job domain shared by API, CLI and worker; no torch, worker or kernels
  jobs/api/     the FastAPI app over jobs.domain and storage; no torch, worker or kernels
  jobs/cli/     the `freight` command; the only part of jobs/ that may import worker, and only lazily
  worker/       Celery tasks and the engine's drivers; may use jobs.domain and storage, never jobs.api or
                jobs.cli
  worker/engine/, kernels/   the offline engine and its kernels: no celery, sqlalchemy, fastapi, jobs or
                storage

and no import cycles among the modules of jobs/ (module-level imports, `if TYPE_CHECKING:` included).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jobs", "worker", "storage", "kernels")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. jobs.domain.service
    path: Path  # its file
    line: int
    target: str  # the imported module, e.g. storage.blobs (or `pkg.name` when that is a module)
    module_level: bool  # False: inside a function (a lazy import)

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def __str__(self) -> str:
        kind = "" if self.module_level else " (inside a function)"
        return f"{self.where()}: imports {self.target}{kind}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def source_files() -> tuple[Path, ...]:
    return tuple(
        sorted(
            path
            for package in PACKAGES
            for path in (ROOT / package).rglob("*.py")
            if "__pycache__" not in path.parts
        )
    )


@cache
def first_party_modules() -> frozenset[str]:
    return frozenset(module_name(path) for path in source_files())


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _walk(node: ast.AST, in_function: bool):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        yield from _walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))


@cache
def all_imports() -> tuple[Import, ...]:
    modules = first_party_modules()
    found: list[Import] = []
    for path in source_files():
        source = module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, in_function in _walk(tree, False):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(source, path.name == "__init__.py", node)
                # `from jobs.cli import admin` imports the module jobs.cli.admin
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in dict.fromkeys(targets):
                found.append(Import(source, path, node.lineno, target, not in_function))
    return tuple(found)


def _under(module: str, *roots: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def imports_from(*roots: str) -> list[Import]:
    return [imp for imp in all_imports() if _under(imp.source, *roots)]


def _report(rule: str, offenders: list[Import]) -> str:
    return f"{rule}; {len(offenders)} offending import(s):\n  " + "\n  ".join(map(str, offenders))


def test_the_checker_sees_the_packages() -> None:
    """Guards the other tests against passing vacuously (a wrong ROOT, a renamed package)."""
    modules = first_party_modules()
    for expected in ("jobs.domain.service", "jobs.api.app", "jobs.cli.main", "worker.tasks", "storage.db"):
        assert expected in modules, f"{expected} not found under {ROOT}"
    assert any(imp.target == "jobs.domain.service" for imp in imports_from("jobs.api"))


def test_rule_1_worker_uses_only_jobs_domain() -> None:
    offenders = [
        imp
        for imp in imports_from("worker")
        if _under(imp.target, "jobs") and not _under(imp.target, "jobs.domain")
    ]
    assert not offenders, _report(
        "Rule 1: worker/ may import jobs.domain and storage, never jobs.api or jobs.cli "
        "(move what the worker needs into jobs/domain/)",
        offenders,
    )


def test_rule_2_only_jobs_cli_imports_worker_and_only_lazily() -> None:
    outside = [
        imp
        for imp in imports_from("jobs", "storage")
        if _under(imp.target, "worker") and not _under(imp.source, "jobs.cli")
    ]
    assert not outside, _report("Rule 2: only jobs/cli may import worker", outside)
    eager = [imp for imp in imports_from("jobs.cli") if _under(imp.target, "worker") and imp.module_level]
    assert not eager, _report(
        "Rule 2: jobs/cli may import worker only inside functions (lazily), so that `freight` starts "
        "without the engine",
        eager,
    )


def test_rule_3_api_and_domain_import_no_torch_worker_or_kernels() -> None:
    offenders = [
        imp
        for imp in imports_from("jobs.api", "jobs.domain")
        if _under(imp.target, "torch", "worker", "kernels")
    ]
    assert not offenders, _report(
        "Rule 3: jobs/api and jobs/domain never import torch, worker or kernels", offenders
    )


def test_rule_3b_domain_is_below_api_and_cli() -> None:
    offenders = [imp for imp in imports_from("jobs.domain") if _under(imp.target, "jobs.api", "jobs.cli")]
    offenders += [imp for imp in imports_from("jobs.api") if _under(imp.target, "jobs.cli")]
    assert not offenders, _report(
        "Rule 3b: jobs/domain imports neither jobs.api nor jobs.cli, and jobs/api does not import jobs.cli",
        offenders,
    )


def test_rule_4_storage_imports_nothing_from_jobs_worker_or_kernels() -> None:
    offenders = [imp for imp in imports_from("storage") if _under(imp.target, "jobs", "worker", "kernels")]
    assert not offenders, _report("Rule 4: storage/ imports nothing from jobs, worker or kernels", offenders)


def test_rule_5_engine_and_kernels_import_no_service_code() -> None:
    offenders = [
        imp
        for imp in imports_from("worker.engine", "kernels")
        if _under(imp.target, "celery", "sqlalchemy", "fastapi", "jobs", "storage")
    ]
    assert not offenders, _report(
        "Rule 5: worker/engine/ and kernels/ import no celery, sqlalchemy, fastapi, jobs or storage",
        offenders,
    )


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_rule_6_no_import_cycles_inside_jobs() -> None:
    modules = {module for module in first_party_modules() if _under(module, "jobs")}
    graph: dict[str, set[str]] = {module: set() for module in modules}
    lines: dict[tuple[str, str], str] = {}
    for imp in imports_from("jobs"):
        if not imp.module_level:
            continue
        # importing jobs.a.b runs jobs/a/__init__.py first (the importer's own packages already run)
        parts = imp.target.split(".")
        for target in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
            if target in modules and target != imp.source and not _under(imp.source, target):
                graph[imp.source].add(target)
                lines.setdefault((imp.source, target), imp.where())
    cycle = _cycle(graph)
    assert cycle is None, (
        "Rule 6: import cycle among the modules of jobs/ (module-level imports):\n  "
        + "\n  ".join(f"{a} -> {b} ({lines[a, b]})" for a, b in zip(cycle, cycle[1:], strict=False))
    )
