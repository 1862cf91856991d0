"""The layering of the packages, checked statically (Python's ast) over every .py file in jobs/, worker/,
storage/ and kernels/, counting both module-level imports and imports inside functions:

  storage/      the database and blob stores; imports nothing from jobs, worker or kernels
  jobs/domain/  the job domain shared by API, CLI and worker; no torch, worker or kernels
  jobs/api/     the FastAPI app over jobs.domain and storage; no torch, worker or kernels
  jobs/cli/     the `freight` command; the only part of jobs/ that may import worker, and only lazily
  worker/       Celery tasks and the engine's drivers; may use jobs.domain and storage, never jobs.api or
                jobs.cli
  worker/engine/, kernels/   the offline engine and its kernels: no celery, sqlalchemy, fastapi, jobs or
                storage, except jobs.domain.engine_options: the engine's options, read by both the engine
                and the settings object, so it imports the standard library only

and no import cycles among the modules of jobs/, worker/, storage/ and kernels/ (every import counts: module
level, `if TYPE_CHECKING:`, and inside functions, since a lazy import that closes a cycle only hides it).
The CLI takes nothing from jobs/api but the server it starts (`freight api`); jobs/api and jobs/domain run
engine code only through entry points declared in pyproject.toml, never by a module path in a string.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jobs", "worker", "storage", "kernels")
ENGINE_OPTIONS = "jobs.domain.engine_options"  # the one jobs module the engine reads (rule 5b)


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
        if _under(imp.target, "celery", "sqlalchemy", "fastapi", "jobs", "storage") and imp.target != ENGINE_OPTIONS
    ]
    assert not offenders, _report(
        "Rule 5: worker/engine/ and kernels/ import no celery, sqlalchemy, fastapi, jobs or storage",
        offenders,
    )


def test_rule_5b_engine_options_import_the_standard_library_only() -> None:
    """jobs.domain (no torch, no worker) and worker.engine (no jobs but this module) both read the engine's
    options: that module (and the packages above it, jobs and jobs.domain: docstrings only) stays standard
    library only, so the engine remains usable alone."""
    import sys

    offenders = [
        imp
        for imp in all_imports()
        if imp.source in (ENGINE_OPTIONS, "jobs", "jobs.domain")
        and imp.target.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
    ]
    assert imports_from(ENGINE_OPTIONS), f"{ENGINE_OPTIONS} not found"
    assert not offenders, _report("Rule 5b: engine_options imports the standard library only", offenders)


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


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """module -> the first-party modules it imports (every import, lazy and TYPE_CHECKING ones included),
    and where each edge is written."""
    modules = first_party_modules()
    graph: dict[str, set[str]] = {module: set() for module in modules}
    lines: dict[tuple[str, str], str] = {}
    for imp in all_imports():
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first (the importer's own packages ran)
        parts = imp.target.split(".")
        for target in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
            if target in modules and target != imp.source and not _under(imp.source, target):
                graph[imp.source].add(target)
                lines.setdefault((imp.source, target), str(imp))
    return graph, lines


def test_rule_6_no_import_cycles() -> None:
    graph, lines = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, (
        "Rule 6: import cycle among the modules of jobs/, worker/, storage/ and kernels/ (a lazy or "
        "TYPE_CHECKING import counts: move what both sides need into a module of its own):\n  "
        + "\n  ".join(f"{a} -> {b} ({lines[a, b]})" for a, b in zip(cycle, cycle[1:], strict=False))
    )


def test_rule_6_sees_the_cycles_that_were_removed() -> None:
    """The cycle finder finds a cycle where one is (else rule 6 passes vacuously), and the edges whose
    return made the removed cycles stay one way: the sequence holds a DraftState (draft_state.py) without
    importing the speculator; the int8 linear and the oneDNN prepacking share kernels/quantize.py."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    graph, _ = import_graph()
    assert "worker.engine.draft_state" in graph["worker.engine.sequence"]
    assert "worker.engine.sequence" in graph["worker.engine.speculation"]
    assert "worker.engine.speculation" not in graph["worker.engine.sequence"]
    assert graph["worker.engine.draft_state"] == set(), "draft_state.py reads its sequence through a Protocol"
    assert "kernels.cpu_int8_linear" in graph["kernels.int8_linear"]
    assert "kernels.int8_linear" not in graph["kernels.cpu_int8_linear"]
    for user in ("kernels.int8_linear", "kernels.cpu_int8_linear", "kernels.kv_cache",
                 "worker.engine.quantization"):  # fmt: skip
        assert "kernels.quantize" in graph[user], f"{user} quantizes with kernels/quantize.py"
    assert graph["kernels.quantize"] <= {"kernels", "kernels._checks"}


def test_rule_7_the_cli_takes_only_the_server_from_jobs_api() -> None:
    """The CLI's report and everything else it shows come from jobs/domain; `freight api` starts the server
    (jobs.api.server), lazily, and that is all it takes from jobs/api."""
    offenders = [
        imp
        for imp in imports_from("jobs.cli")
        if _under(imp.target, "jobs.api") and (imp.target != "jobs.api.server" or imp.module_level)
    ]
    assert not offenders, _report(
        "Rule 7: jobs/cli imports from jobs/api only jobs.api.server, inside the `freight api` command "
        "(move what the CLI needs into jobs/domain/)",
        offenders,
    )


MODULE_PATH = re.compile(r"(worker|kernels)(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")


def test_rule_8_engine_code_runs_through_declared_entry_points() -> None:
    """jobs/api and jobs/domain name no module of worker/ or kernels/ in a string (`python -m ...`,
    importlib): what they run of the engine is an entry point of pyproject.toml, and each declared entry
    point names a function that exists."""
    offenders = []
    for path in source_files():
        if not _under(module_name(path), "jobs.api", "jobs.domain"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if MODULE_PATH.fullmatch(node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "Rule 8: a module path in a string (declare an entry point):\n  " + "\n  ".join(
        offenders
    )

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    grammar_check = (ROOT / "jobs/domain/grammar_check.py").read_text(encoding="utf-8")
    assert re.search(r'CHECK_COMMAND = "freight-grammar-check"', grammar_check)
    assert scripts["freight-grammar-check"] == "worker.engine.grammar_check:main"
    for name, target in scripts.items():
        module, function = target.split(":")
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert function in defined, f"entry point {name}: {module} has no function {function}"
