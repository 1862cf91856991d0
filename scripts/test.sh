#!/usr/bin/env bash
# The README's test command: lint, the docs build, then the whole suite (Postgres and Redis must be up).
# --fast: the unit tests only (no real-process service tests in tests/service, nothing marked slow).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
# the docs site: --strict turns a broken link or anchor into a failure (docs/configuration.md is checked by
# tests/test_docs.py against the settings object). Not --quiet: it hides the warnings that --strict counts.
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$site"
rm -rf "$site"
# tests share the model cache that setup.sh filled, instead of converting the model again
export FREIGHT_TEST_MODELS_DIR="${FREIGHT_TEST_MODELS_DIR:-$(.venv/bin/python -c 'from worker.engine.loader import default_cache_dir; print(default_cache_dir())')}"
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not slow" --ignore=tests/service "$@"
fi
.venv/bin/python -m pytest -q -ra --durations=30 "$@"  # the slowest tests: where CI time goes
