#!/usr/bin/env bash
# The README's test command: lint, the docs build, then the whole suite (Postgres and Redis must be up).
# --unit: lint, then the unit lane only: the tests marked `unit` (pytest.mark.unit, in their files), run
# where nothing else is: Postgres and Redis pointed at a closed port (a test that reaches for them fails:
# CI=true turns the service fixtures' skip into a failure), an empty model cache with pip offline (a model
# pull fails), the compiled CPU kernels off (FREIGHT_CPU_KERNELS=0: the torch reference paths). Tiny
# models carry a tokenizer built in the test. Under a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
if [ "${1:-}" = "--unit" ]; then
  shift
  closed="127.0.0.1:9"  # the discard port: nothing listens there
  models="$(mktemp -d)"
  trap 'rm -rf "$models"' EXIT
  # only the files that hold unit tests are collected, so the others' imports (torch, services) cost nothing
  mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.unit\b' tests | sort)
  CI=true FREIGHT_CPU_KERNELS=0 FREIGHT_TEST_MODELS_DIR="$models" PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 \
    FREIGHT_TEST_PG_ADMIN_URL="postgresql://postgres@$closed/postgres" FREIGHT_TEST_REDIS_URL="redis://$closed" \
    FREIGHT_DATABASE_URL="postgresql+psycopg://postgres@$closed/freight" FREIGHT_BROKER_URL="redis://$closed/0" \
    .venv/bin/python -m pytest -q -ra -m unit -p no:cacheprovider "${files[@]}" "$@"
  exit
fi
# the docs site: --strict turns a broken link or anchor into a failure (docs/configuration.md is checked by
# tests/test_docs.py against the settings object). Not --quiet: it hides the warnings that --strict counts.
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$site"
rm -rf "$site"
# tests share the model cache that setup.sh filled, instead of converting the model again
export FREIGHT_TEST_MODELS_DIR="${FREIGHT_TEST_MODELS_DIR:-$(.venv/bin/python -c 'from worker.engine.loader import default_cache_dir; print(default_cache_dir())')}"
.venv/bin/python -m pytest -q -ra --durations=30 "$@"  # the slowest tests: where CI time goes
