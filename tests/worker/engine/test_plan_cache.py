"""The plan's one measurement cache (worker/engine/plan/measure.py): a bad file (corrupt, truncated, of another
format, being written while it is read) gives a plan, never a crash, with one warning per file; processes
making the plan at once measure once."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.engine.config import EngineConfig, ModelConfig
from worker.engine.plan import timing
from worker.engine.plan.execution_plan import ExecutionPlan
from worker.engine.plan.make import make_plan
from worker.engine.plan.measure import FORMAT, LOCK_NAME

CPU = torch.device("cpu")
MODEL = "ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True)"  # fmt: skip
SMALL: ModelConfig = eval(MODEL)  # the same text runs in the subprocesses below
CONFIG = {"quantization": "int8"}  # an INT8 plan measures every entry: schemes, attention, small batch
LOGGER = "worker.engine.plan.measure"


def config() -> EngineConfig:
    return EngineConfig(model="unused", **CONFIG)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache every measurement here, even when other test processes keep the machine busy (the contention
    rule is tested in test_timing.py)."""
    monkeypatch.setattr(timing, "CONTENDED_SHARE", float("inf"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ExecutionPlan]]:
    """A cache folder holding every entry of SMALL's plan, measured once for the module (copied per test)."""
    folder = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "CONTENDED_SHARE", float("inf"))
        plan = make_plan(config(), SMALL, CPU, folder)
    assert plan.source == "measured"
    yield folder, plan


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def copy_of(measured: tuple[Path, ExecutionPlan], tmp_path: Path) -> Path:
    folder = tmp_path / "calibration"
    shutil.copytree(measured[0], folder)
    return folder


def whole(path: Path) -> str:
    return path.read_text()


BAD_FILES = {
    "corrupt": lambda path: "{\"format\": 3, \"seconds\": {\"float32\": 0.1,,}",
    "truncated": lambda path: whole(path)[: len(whole(path)) // 2],
    "empty": lambda path: "",
    "foreign version": lambda path: json.dumps(json.loads(whole(path)) | {"format": FORMAT + 1}),
    "before the format": lambda path: json.dumps({"seconds_per_token": {"float32": 0.1}}),  # the old layout
    "not a table": lambda path: json.dumps({"format": FORMAT, "seconds": [1, 2]}),
    "not text": lambda path: "\udcff",  # written below as bytes that are no UTF-8
}


@pytest.mark.parametrize("which", ["schemes", "kernels"])
@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_cache_file_gives_a_plan_and_one_warning(
    measured: tuple[Path, ExecutionPlan], tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, which: str
) -> None:
    """which: the scheme measurement's file, or every other one (attention, small batch). Not both at once: a
    scheme measured again can pick another dtype or backend, whose kernel entries are other files."""
    folder = copy_of(measured, tmp_path)
    bad = [path for path in entries(folder) if ("-" in path.stem) == (which == "kernels")]
    assert len(bad) == (1 if which == "schemes" else 2)  # the schemes; attention and small batch
    for path in bad:
        text = BAD_FILES[kind](path)
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plan = make_plan(config(), SMALL, CPU, folder)
    assert isinstance(plan, ExecutionPlan) and plan.scheme.quantization == "int8"
    assert plan.source == ("measured" if which == "schemes" else "cache")
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert all("ignoring it and measuring again" in w for w in warnings)
    assert sorted(w.split(" ", 3)[2] for w in warnings) == sorted(map(str, bad))  # one line per bad file
    for path in bad:  # measured again and overwritten with a whole file of this format
        assert json.loads(path.read_text())["format"] == FORMAT
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = make_plan(config(), SMALL, CPU, folder)
    assert again.source == "cache" and again.scheme == plan.scheme
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_a_cache_file_written_while_it_is_read_gives_a_plan(
    measured: tuple[Path, ExecutionPlan], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that does not replace the file atomically (another build, a copy by hand) rewrites every entry
    in place, in pieces, while plans are made: each make_plan reads a whole file, a part of one (ignored and
    measured again) or none, and gives a plan."""
    folder = copy_of(measured, tmp_path)
    texts = {path: whole(path) for path in entries(folder)}
    (folder / ".leftover.json.123.partial").write_text('{"format"')  # a writer that died: not an entry
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            for path, text in texts.items():
                with open(path, "w") as out:
                    out.write(text[: len(text) // 3])
                    out.flush()
                    os.fsync(out.fileno())
                    out.write(text[len(text) // 3 :])

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            plans = []
            for _ in range(3):
                caplog.clear()
                plans.append(make_plan(config(), SMALL, CPU, folder))
                warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
                assert len(warnings) <= len(texts)  # at most one line per file
    finally:
        stop.set()
        thread.join()
    assert all(isinstance(p, ExecutionPlan) and p.scheme.quantization == "int8" for p in plans)


PLAN_SCRIPT = f"""
import json, logging, sys
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from worker.engine.config import EngineConfig, ModelConfig
from worker.engine.plan import timing
from worker.engine.plan.make import make_plan
timing.CONTENDED_SHARE = float("inf")  # the two processes keep each other busy: cache all the same
plan = make_plan(EngineConfig(model="unused", **{CONFIG!r}), {MODEL}, torch.device("cpu"), Path(sys.argv[1]))
print(json.dumps({{"scheme": plan.scheme.name, "source": plan.source, "small_batch_rows": plan.small_batch_rows,
                  "attention": plan.attention.seconds if plan.attention else None}}))
"""


def test_two_processes_planning_at_once_measure_once(tmp_path: Path) -> None:
    folder = tmp_path / "calibration"
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = [
        subprocess.Popen([sys.executable, "-c", PLAN_SCRIPT, str(folder)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=root)  # fmt: skip
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (_out, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err
    plans = [json.loads(out) for out, _ in outputs]
    measured_lines = [line for _, err in outputs for line in err.splitlines() if f"{LOGGER} INFO measured " in line]
    names = sorted(line.split(" measured ", 1)[1].split(" in ")[0] for line in measured_lines)
    assert names == sorted(path.stem for path in entries(folder))  # every entry measured, each by one process
    assert len(names) >= 2  # the schemes and attention at least
    assert sorted(p["source"] for p in plans) == ["cache", "measured"]
    assert plans[0] == plans[1] | {"source": plans[0]["source"]}  # the same plan in both
    assert (folder / LOCK_NAME).exists()
