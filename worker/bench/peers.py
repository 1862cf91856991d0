"""The CPU peers of `freight bench` (CTranslate2, OpenVINO GenAI, llama.cpp), each from a venv of its own.

None of them is a dependency of Freight: scripts/peers/setup.sh builds their venvs outside the repo
(FREIGHT_PEERS_HOME, default peers/ beside it) and scripts/peers/X_baseline.py is each one's runner,
with vLLM's contract (vllm_peer.py): the bench writes the workload Parquet, runs the script with the
peer's python, reads back one JSON report and the output tokens, and checks that every request got
exactly its output length. A run past the timeout is an upper bound on the peer's rate. A peer's
model is converted from the bench's HF folder once (the script's --convert) into
FREIGHT_PEERS_HOME/models/<folder name>/<format>.

`peer_table` is the summary the bench prints after the peers: each system's rate against Freight's
defaults and how many of its first greedy tokens agree with Freight's float32 path, a check of the
peer's setup (a wrong chat template or EOS handling shows up as agreement near zero).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from worker.bench.peak_rss import PeakRSS
from worker.bench.sharegpt import Workload
from worker.bench.vllm_peer import write_workload

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "peers"
HOME_ENV = "FREIGHT_PEERS_HOME"
AGREEMENT_TOKENS = 16
# what a peer's child must not inherit from Freight's process: it runs in a venv of its own
FOREIGN_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Peer:
    system: str  # its name in `freight bench --systems`
    script: str  # its runner under scripts/peers/
    venv: str  # its venv's folder under FREIGHT_PEERS_HOME (scripts/peers/setup.sh)
    model_format: str  # its converted model's folder under FREIGHT_PEERS_HOME/models/<model>/

    @property
    def python_env(self) -> str:
        """The environment variable naming its python, when not the venv's under FREIGHT_PEERS_HOME."""
        return f"FREIGHT_{self.system.upper()}_PYTHON"


PEERS: Mapping[str, Peer] = MappingProxyType({
    "ctranslate2": Peer("ctranslate2", "ct2_baseline.py", "ct2-venv", "ct2-int8"),
    "openvino": Peer("openvino", "openvino_baseline.py", "openvino-venv", "openvino-int8"),
    "llamacpp": Peer("llamacpp", "llamacpp_baseline.py", "llamacpp-venv", "gguf-q8_0"),
})  # fmt: skip


def peers_home(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get(HOME_ENV) or REPO.parent / "peers")


def peer_python(peer: Peer, explicit: str | None, home: Path) -> Path | None:
    """The peer's python: the flag, else its environment variable, else its venv's if that exists."""
    named = explicit or os.environ.get(peer.python_env)
    if named:
        return Path(named)
    default = home / peer.venv / "bin" / "python"
    return default if default.is_file() else None


def peer_environment(threads: int) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in FOREIGN_ENV}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


@dataclass
class ChildRun:
    returncode: int | None  # None: stopped at the timeout
    stderr: str
    peak_rss_mb: float  # the process tree's peak (a runner's own children, llama.cpp's server, included)


def run_child(command: list[str], env: Mapping[str, str], timeout_s: float) -> ChildRun:
    """Run `command` in a process group of its own, killing the group at the timeout.

    A group, because a peer's runner has children of its own (llama.cpp's server) that must not go on
    using the cores after the runner is stopped.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, env=dict(env), stdout=out, stderr=err, text=True, start_new_session=True)
        peak = PeakRSS(child.pid)
        try:
            returncode: int | None = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            returncode = None
        peak_mb = peak.peak_mb()
        err.seek(0)
        return ChildRun(returncode, err.read(), peak_mb)


def converted_model(
    peer: Peer, python: Path, hf_path: Path, home: Path, timeout_s: float = 3600.0, script: Path | None = None
) -> Path:
    """The peer's conversion of the HF folder, made once by its script's --convert."""
    target = home / "models" / hf_path.name / peer.model_format
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    command = [str(python), str(script or SCRIPTS / peer.script), "--convert", str(hf_path), "--out", str(target)]
    done = run_child(command, peer_environment(len(os.sched_getaffinity(0))), timeout_s)
    if done.returncode != 0 or not target.exists():
        tail = "timed out" if done.returncode is None else done.stderr[-3000:]
        raise RuntimeError(f"{peer.system}: converting {hf_path} failed:\n{tail}")
    return target


def check_tokens(system: str, tokens: Sequence[Sequence[int]], workload: Workload) -> None:
    """Exactly one output per request, each exactly the workload's output length."""
    if len(tokens) != len(workload):
        raise RuntimeError(f"{system}: {len(tokens)} outputs for {len(workload)} requests")
    wrong = [i for i, ids in enumerate(tokens) if len(ids) != workload.output_len]
    if wrong:
        raise RuntimeError(
            f"{system}: {len(wrong)} requests did not produce exactly {workload.output_len} tokens "
            f"(request {wrong[0]}: {len(tokens[wrong[0]])})"
        )


def run_peer(
    peer: Peer, *, python: Path, model: Path, workload: Workload, threads: int, timeout_s: float,
    script: Path | None = None, extra_args: Sequence[str] = (),
) -> tuple[dict[str, Any], list[list[int]] | None]:
    """The peer's JSON report and its output tokens in workload order; tokens None when it timed out."""
    script = script or SCRIPTS / peer.script
    with tempfile.TemporaryDirectory(prefix=f"freight-{peer.system}-") as tmp:
        workload_path, tokens_path = Path(tmp) / "workload.parquet", Path(tmp) / "tokens.json"
        report_path = Path(tmp) / "report.json"
        write_workload(workload, workload_path)
        command = [str(python), str(script), "--workload", str(workload_path), "--model", str(model),
                   "--threads", str(threads), "--report", str(report_path), "--dump-tokens", str(tokens_path),
                   *extra_args]  # fmt: skip
        started = time.perf_counter()
        done = run_child(command, peer_environment(threads), timeout_s)
        if done.returncode is None:  # its figure is an upper bound, not a result to compare
            elapsed = time.perf_counter() - started
            total = workload.prompt_tokens + len(workload) * workload.output_len
            return {"system": peer.system, "did_not_finish_s": round(elapsed, 1),
                    "total_tokens_per_s_below": round(total / elapsed, 2), "peak_rss_mb": done.peak_rss_mb}, None  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{peer.system}: {script.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        report = json.loads(report_path.read_text())
        tokens = json.loads(tokens_path.read_text())["output_token_ids"]
    check_tokens(peer.system, tokens, workload)
    return {"system": peer.system, **report, "peak_rss_mb": done.peak_rss_mb}, tokens


# the fields the bench computes itself from a run (SystemResult.as_dict); the rest of a report is settings
MEASURED = frozenset({"system", "requests", "prompt_tokens", "output_tokens", "elapsed_s", "requests_per_s",
                      "total_tokens_per_s", "output_tokens_per_s", "load_s", "model", "workload"})  # fmt: skip


def report_settings(report: Mapping[str, Any]) -> dict[str, Any]:
    """A peer report's settings (engine, version, batch sizes, peak RSS), without what the bench measures."""
    return {key: value for key, value in report.items() if key not in MEASURED}


def first_tokens_agreement(
    outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], n: int = AGREEMENT_TOKENS
) -> dict[str, float]:
    """Over each request's first n tokens: the mean share that matches up to the first difference, and
    the share of requests whose first n tokens are all the same."""
    prefixes, identical = [], 0
    for ours, theirs in zip(outputs, reference, strict=True):
        ours, theirs = list(ours[:n]), list(theirs[:n])
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
        prefixes.append(same / max(len(theirs), 1))
        identical += ours == theirs
    count = max(len(prefixes), 1)
    return {"prefix": round(sum(prefixes) / count, 4), "identical": round(identical / count, 4)}


def peer_table(
    rows: Sequence[Mapping[str, Any]], tokens: Mapping[str, Sequence[Sequence[int]]], *, freight: str = "freight",
    reference: str = "freight-fp32", freight_systems: Sequence[str] = (),
) -> dict[str, Any]:
    """Each non-Freight system's rate, Freight's defaults over it, and its first-16 agreement with `reference`.

    `rows` are the systems' JSON lines (a timed-out one with total_tokens_per_s_below), `tokens` their
    outputs by system. The fastest finished peer sets `freight_over_fastest`.
    """
    by_system = {row["system"]: row for row in rows}
    ours = by_system.get(freight, {}).get("total_tokens_per_s")
    ref_tokens = tokens.get(reference)
    table = []
    for row in rows:
        system = row["system"]
        if system == freight or system in freight_systems:
            continue
        entry: dict[str, Any] = {"system": system}
        if "total_tokens_per_s" in row:
            entry["total_tokens_per_s"] = row["total_tokens_per_s"]
            entry["requests"] = row.get("requests")
            if ours:
                entry["freight_over_it"] = round(ours / max(row["total_tokens_per_s"], 1e-9), 3)
        else:
            entry["total_tokens_per_s_below"] = row["total_tokens_per_s_below"]
            if ours:
                entry["freight_over_it_at_least"] = round(ours / max(row["total_tokens_per_s_below"], 1e-9), 3)
        if ref_tokens is not None and system in tokens:
            entry[f"first{AGREEMENT_TOKENS}_vs_{reference}"] = first_tokens_agreement(tokens[system], ref_tokens)
        table.append(entry)
    finished = [e for e in table if "total_tokens_per_s" in e]
    fastest = max(finished, key=lambda e: e["total_tokens_per_s"], default=None)
    summary: dict[str, Any] = {"peer_table": table, "freight": freight, "freight_total_tokens_per_s": ours,
                               "agreement_reference": reference if ref_tokens is not None else None}  # fmt: skip
    if ref_tokens is not None and freight in tokens:  # what quantization alone moves, for scale
        summary[f"freight_first{AGREEMENT_TOKENS}_vs_{reference}"] = first_tokens_agreement(tokens[freight], ref_tokens)
    if fastest is not None and ours:
        summary["fastest"] = fastest["system"]
        summary["freight_over_fastest"] = fastest.get("freight_over_it")
    return summary


def agreement(shares: Mapping[str, float] | None) -> str:
    return f"{shares['prefix']:.3f} / {shares['identical']:.3f}" if shares else ""


def format_table(summary: Mapping[str, Any]) -> str:
    """The peer table as Markdown rows, for reading at the end of the bench's output."""
    agreement_key = f"first{AGREEMENT_TOKENS}_vs_{summary.get('agreement_reference')}"
    lines = [
        f"| system | total tokens/s | {summary['freight']} / system | first {AGREEMENT_TOKENS} tokens vs "
        f"{summary.get('agreement_reference') or '(no float32 run)'}: prefix / identical |",
        "|---|---|---|---|",
        f"| {summary['freight']} | {summary.get('freight_total_tokens_per_s')} | 1.00x | "
        f"{agreement(summary.get('freight_' + agreement_key))} |",
    ]
    for entry in summary["peer_table"]:
        if "total_tokens_per_s" in entry:
            rate, ratio = f"{entry['total_tokens_per_s']}", f"{entry.get('freight_over_it', '?')}x"
        else:
            rate, ratio = f"< {entry['total_tokens_per_s_below']} (stopped)", f">= {entry.get('freight_over_it_at_least')}x"
        lines.append(f"| {entry['system']} | {rate} | {ratio} | {agreement(entry.get(agreement_key))} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's peer flags."""
    parser.add_argument("--peers", action="store_true",
                        help=f"add every peer whose venv is found ({', '.join(PEERS)}), with freight and freight-fp32 "
                             "(the agreement reference)")  # fmt: skip
    parser.add_argument("--peers-home", help=f"the peers' venvs and converted models (default ${HOME_ENV}, "
                                             "else peers/ beside the repo; scripts/peers/setup.sh)")  # fmt: skip
    for peer in PEERS.values():
        parser.add_argument(f"--{peer.system}-python",
                            help=f"{peer.system}'s python (default ${peer.python_env}, else HOME/{peer.venv})")  # fmt: skip
    parser.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds before a peer's run is stopped")


def resolve_systems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Add the peers (and Freight's two reference systems) --peers asks for; set args.peer_pythons."""
    home = peers_home(args.peers_home)
    pythons = {name: peer_python(peer, getattr(args, f"{name}_python"), home) for name, peer in PEERS.items()}
    if args.peers:
        found = [name for name, python in pythons.items() if python is not None]
        if not found:
            parser.error(f"--peers: no peer venv under {home} (scripts/peers/setup.sh) and no --PEER-python")
        missing = [s for s in ("freight", "freight-fp32") if s not in args.systems]
        args.systems = missing + args.systems + [name for name in found if name not in args.systems]
    unset = [name for name in PEERS if name in args.systems and pythons[name] is None]
    if unset:
        parser.error(f"--systems {', '.join(unset)}: no venv under {home} and no --PEER-python "
                     f"(scripts/peers/setup.sh)")  # fmt: skip
    args.peers_home = home
    args.peer_pythons = {name: python for name, python in pythons.items() if python is not None}


def main(argv: list[str]) -> int:
    """`python -m worker.bench.peers convert --model M [--systems a,b]`: the peers' conversions of M."""
    parser = argparse.ArgumentParser(prog="python -m worker.bench.peers")
    parser.add_argument("command", choices=("convert",))
    parser.add_argument("--model", required=True, help="alias or HF folder")
    parser.add_argument("--systems", default=",".join(PEERS))
    parser.add_argument("--cache-dir", default=None, help="Freight's models cache")
    parser.add_argument("--peers-home")
    args = parser.parse_args(argv)
    from worker.engine.loader import resolve_model_path

    home = peers_home(args.peers_home)
    hf_path = resolve_model_path(args.model, args.cache_dir)
    for name in [s.strip() for s in args.systems.split(",") if s.strip()]:
        peer = PEERS[name]
        python = peer_python(peer, None, home)
        if python is None:
            raise SystemExit(f"{name}: no venv under {home}")
        print(f"{name}: {converted_model(peer, python, hf_path, home)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
