#!/usr/bin/env bash
# The README's test command: lint, then the whole suite (Postgres and Redis must be up).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -ra "$@"
