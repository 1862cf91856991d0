"""The CPU peers' driver (worker/bench/peers.py) against a fake runner that follows their contract.

No peer is installed here: tests/worker/fake_peer.py stands in for scripts/peers/X_baseline.py, on the
real shared code of those scripts (scripts/peers/peer_common.py), run as a child process as the real
ones are.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from worker.bench import peers
from worker.bench.run import parse_args
from worker.bench.sharegpt import Workload

pytestmark = pytest.mark.unit

FAKE = Path(__file__).with_name("fake_peer.py")
PEER = peers.PEERS["ctranslate2"]
OUTPUT_LEN = 12


def workload() -> Workload:
    return Workload(file_indices=[7, 8, 9], prompt_token_ids=[[1, 2, 3], [4, 5], [6]], output_len=OUTPUT_LEN,
                    max_prompt_len=16, truncated_prompts=0)  # fmt: skip


def expected_tokens(wl: Workload) -> list[list[int]]:
    return [[(p[-1] + t) % 1000 for t in range(wl.output_len)] for p in wl.prompt_token_ids]


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    hf = tmp_path / "tiny-model"
    hf.mkdir()
    return peers.converted_model(PEER, Path(sys.executable), hf, tmp_path / "home", script=FAKE)


def run_fake(converted: Path, monkeypatch: pytest.MonkeyPatch, mode: str, timeout_s: float = 60.0):
    monkeypatch.setenv("FAKE_PEER_MODE", mode)
    return peers.run_peer(PEER, python=Path(sys.executable), model=converted, workload=workload(), threads=2,
                          timeout_s=timeout_s, script=FAKE)  # fmt: skip


def test_conversion_runs_once_into_the_peers_home(tmp_path: Path, converted: Path) -> None:
    assert converted == tmp_path / "home" / "models" / "tiny-model" / "ct2-int8"
    assert (converted / "converted-from").read_text() == str(tmp_path / "tiny-model")
    (converted / "converted-from").write_text("kept")
    again = peers.converted_model(PEER, Path(sys.executable), tmp_path / "tiny-model", tmp_path / "home", script=FAKE)
    assert again == converted and (converted / "converted-from").read_text() == "kept"


def test_a_failed_conversion_names_the_peer_and_leaves_no_folder(tmp_path: Path) -> None:
    failing = tmp_path / "failing.py"
    failing.write_text("import sys; print('no converter here', file=sys.stderr); sys.exit(1)\n")
    with pytest.raises(RuntimeError, match="ctranslate2: converting .* failed:\nno converter here"):
        peers.converted_model(PEER, Path(sys.executable), tmp_path / "m", tmp_path / "home", script=failing)
    assert not (tmp_path / "home" / "models" / "m" / "ct2-int8").exists()


def test_the_report_and_tokens_come_back(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, tokens = run_fake(converted, monkeypatch, "ok")

    wl = workload()
    assert tokens == expected_tokens(wl)
    assert report["system"] == "ctranslate2" and report["engine"] == "fake" and report["threads"] == 2
    assert report["requests"] == 3 and report["prompt_tokens"] == wl.prompt_tokens == 6
    assert report["output_tokens"] == 3 * OUTPUT_LEN and report["elapsed_s"] == 2.0 and report["load_s"] == 0.25
    assert report["total_tokens_per_s"] == (6 + 36) / 2.0 and report["output_tokens_per_s"] == 36 / 2.0
    assert isinstance(report["peak_rss_mb"], float)  # the runner's tree, sampled (a run this short may show 0)
    assert peers.report_settings(report) == {"engine": "fake", "threads": 2, "mode": "ok",
                                             "peak_rss_mb": report["peak_rss_mb"]}  # fmt: skip


def test_a_runner_one_token_short_fails_its_own_check(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)fake_peer.py failed \(3\).*request 1: 11 tokens, not 12"):
        run_fake(converted, monkeypatch, "short")


def test_the_driver_checks_the_count_too(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a runner that reports success with 11 tokens for one request (127 of 128 in the bench)
    with pytest.raises(RuntimeError, match=r"ctranslate2: 1 requests did not produce exactly 12 tokens \(request 1: 11\)"):
        run_fake(converted, monkeypatch, "lie")


def test_a_timeout_gives_an_upper_bound_and_stops_the_runners_children(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_PEER_PID_FILE", str(pid_file))
    started = time.monotonic()
    report, tokens = run_fake(converted, monkeypatch, "slow", timeout_s=5.0)

    assert tokens is None and time.monotonic() - started < 30
    assert report["system"] == "ctranslate2" and report["did_not_finish_s"] >= 5.0
    assert report["total_tokens_per_s_below"] == pytest.approx((6 + 36) / report["did_not_finish_s"], rel=0.05)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        time.sleep(0.1)  # killed with the group; reaped by init once its parent is gone
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_first_tokens_agreement() -> None:
    reference = [list(range(20)), list(range(20)), [5, 6]]
    outputs = [list(range(20)), list(range(8)) + [99] * 12, [5, 7]]
    agreement = peers.first_tokens_agreement(outputs, reference)
    assert agreement == {"prefix": round((1 + 8 / 16 + 1 / 2) / 3, 4), "identical": round(1 / 3, 4)}
    # only the first 16 count: a difference at token 16 is agreement
    assert peers.first_tokens_agreement([list(range(16)) + [0]], [list(range(17))]) == {"prefix": 1.0, "identical": 1.0}


def test_peer_table_ratios_agreement_and_upper_bounds(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ok, ok_tokens = run_fake(converted, monkeypatch, "ok")
    diverging, diverging_tokens = run_fake(converted, monkeypatch, "diverge")
    diverging["system"] = "openvino"
    rows = [
        {"system": "freight", "total_tokens_per_s": 84.0},
        {"system": "freight-fp32", "total_tokens_per_s": 30.0},
        ok,
        diverging,
        {"system": "llamacpp", "did_not_finish_s": 10.0, "total_tokens_per_s_below": 4.2},
    ]
    tokens = {"freight": ok_tokens, "freight-fp32": expected_tokens(workload()), "ctranslate2": ok_tokens,
              "openvino": diverging_tokens}  # fmt: skip
    table = peers.peer_table(rows, tokens, freight_systems=("freight-fp32",))

    by_system = {entry["system"]: entry for entry in table["peer_table"]}
    assert list(by_system) == ["ctranslate2", "openvino", "llamacpp"]
    assert by_system["ctranslate2"]["freight_over_it"] == 4.0
    assert by_system["ctranslate2"]["first16_vs_freight-fp32"] == {"prefix": 1.0, "identical": 1.0}
    # request 0 differs from token 8 on: 8 of its 12 tokens agree
    assert by_system["openvino"]["first16_vs_freight-fp32"] == {"prefix": round((8 / 12 + 2) / 3, 4),
                                                               "identical": round(2 / 3, 4)}  # fmt: skip
    assert by_system["llamacpp"] == {"system": "llamacpp", "total_tokens_per_s_below": 4.2,
                                     "freight_over_it_at_least": 20.0}  # fmt: skip
    assert table["fastest"] == "ctranslate2" and table["freight_over_fastest"] == 4.0
    assert table["freight_first16_vs_freight-fp32"] == {"prefix": 1.0, "identical": 1.0}
    text = peers.format_table(table)
    assert "| freight | 84.0 | 1.00x | 1.000 / 1.000 |" in text
    assert "| ctranslate2 | 21.0 | 4.0x | 1.000 / 1.000 |" in text
    assert "| llamacpp | < 4.2 (stopped) | >= 20.0x |  |" in text


def test_no_float32_run_means_no_agreement(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ok, ok_tokens = run_fake(converted, monkeypatch, "ok")
    table = peers.peer_table([{"system": "freight", "total_tokens_per_s": 21.0}, ok], {"ctranslate2": ok_tokens})
    assert table["agreement_reference"] is None
    assert table["peer_table"] == [{"system": "ctranslate2", "total_tokens_per_s": 21.0, "requests": 3,
                                    "freight_over_it": 1.0}]  # fmt: skip


def fake_venv(home: Path, venv: str) -> Path:
    python = home / venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    return python


def test_peers_flag_adds_the_configured_peers_and_freights_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for peer in peers.PEERS.values():
        monkeypatch.delenv(peer.python_env, raising=False)
    ct2 = fake_venv(tmp_path, "ct2-venv")
    llama = tmp_path / "elsewhere" / "python"
    monkeypatch.setenv("FREIGHT_LLAMACPP_PYTHON", str(llama))

    args = parse_args(["--systems", "vllm", "--vllm-python", sys.executable, "--peers", "--peers-home", str(tmp_path)])
    assert args.systems == ["freight", "freight-fp32", "vllm", "ctranslate2", "llamacpp"]
    assert args.peer_pythons == {"ctranslate2": ct2, "llamacpp": llama}

    monkeypatch.setenv(peers.HOME_ENV, str(tmp_path))
    args = parse_args(["--systems", "freight,ctranslate2", "--ctranslate2-python", "/opt/ct2/bin/python"])
    assert args.systems == ["freight", "ctranslate2"]  # without --peers nothing is added
    assert args.peer_pythons["ctranslate2"] == Path("/opt/ct2/bin/python")


def test_a_peer_without_a_venv_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for peer in peers.PEERS.values():
        monkeypatch.delenv(peer.python_env, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--systems", "freight,openvino", "--peers-home", str(tmp_path)])
    with pytest.raises(SystemExit):  # --peers with no peer found
        parse_args(["--systems", "freight", "--peers", "--peers-home", str(tmp_path)])


def test_the_peer_child_gets_no_freight_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/work/main")
    monkeypatch.setenv("VIRTUAL_ENV", "/work/main/.venv")
    env = peers.peer_environment(2)
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env and env["OMP_NUM_THREADS"] == "2"
    assert env["PATH"] == os.environ["PATH"]
