"""scripts/gpu_e2e.py (the GPU stage of scripts/gpu_check.sh) in its dry-run mode: the same code on CPU with a
tiny Llama-3.1-8B-family shape, so the stage cannot rot between GPU loans."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_e2e", REPO / "scripts" / "gpu_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_stage_runs_on_cpu_in_dry_run(tmp_path: Path, smollm2_path: Path) -> None:
    # the carried layout (scripts/gpu_carry.sh): the tokenizer files of the copied model, no weights
    models = tmp_path / "models"
    (models / "smollm2-135m").mkdir(parents=True)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_path / file, models / "smollm2-135m" / file)
    out = tmp_path / "out"
    assert load_script().main(["--dry-run", "--models-dir", str(models), "--out", str(out)]) == 0
    report = json.loads((out / "gpu_e2e.json").read_text())
    assert report["device"] == "cpu" and "dry run" in report["shape"]
    assert [s["scheme"] for s in report["schemes"]] == ["bf16", "w8a8-int8kv"]
    for scheme in report["schemes"]:
        run = scheme["throughput"]
        assert run["finished"] == run["prompts"] and run["output_tokens"] == run["prompts"] * 8
        assert [s["batch"] for s in scheme["decode_steps"]] == [2, 4]
        assert all(s["decode_steps"] > 0 and s["step_ms"] > 0 and s["bytes_per_step"] > 0 for s in scheme["decode_steps"])
    # INT8 weights and KV read about half the bytes of bfloat16
    bf16, int8 = (s["decode_steps"][0]["bytes_per_step"] for s in report["schemes"])
    assert 0.45 < int8 / bf16 < 0.55
