"""`freight doctor` plans with the engine options a worker loads with: every FREIGHT_* engine setting
(jobs/domain/engine_settings.py, derived from jobs/domain/engine_options.py), then its flags."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.service.fixtures import FREIGHT_BIN


def test_doctor_takes_every_engine_setting(tmp_path: Path, tiny_llama_bytes_dir: Path) -> None:
    env = {**os.environ, "FREIGHT_HOME": str(tmp_path), "FREIGHT_DTYPE": "bfloat16",
           "FREIGHT_QUANTIZATION": "int8", "FREIGHT_INT8_BACKEND": "int_mm", "FREIGHT_SMALL_BATCH_ROWS": "3",
           "FREIGHT_BATCH_INVARIANT_ROWS": "5"}  # fmt: skip
    run = subprocess.run([FREIGHT_BIN, "doctor", "--model", str(tiny_llama_bytes_dir), "--dtype", "float32", "--json"],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    plan = report["plan"]
    # the flag overrides FREIGHT_DTYPE; the settings the CLI has no flag for reach the plan as they are
    assert report["requested"] == {"dtype": "float32", "quantization": "int8"}
    assert plan["scheme"] == "float32+int8/int_mm" and plan["source"] == "fixed"  # one scheme left: not measured
    assert plan["small_batch_rows"] == 3 and plan["small_batch"] is None
    assert plan["invariant_rows"] == 5
