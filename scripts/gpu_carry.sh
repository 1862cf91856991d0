#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh's engine stage needs on a lent GPU machine that it lacks (it reaches no
# package index): run here once, then name `.whl` and `.gpu_models` in the device call's carry.
#   .whl/         wheels for Python 3.12: our transformers version (the image's is older) and platformdirs
#   .gpu_models/  the tokenizer files of the model a random-weight model copies (no weights: a few MB)
set -euo pipefail
cd "$(dirname "$0")/.."
for ignored in /.whl/ /.gpu_models/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
version() { .venv/bin/python -c "from importlib.metadata import version; print(version('$1'))"; }
rm -rf .whl && mkdir -p .whl
for package in transformers platformdirs; do
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$package==$(version "$package")"
done
source="$(.venv/bin/python -c 'from worker.bench.random_model import tokenizer_folder; print(tokenizer_folder("smollm2-135m", None))')"
rm -rf .gpu_models && mkdir -p .gpu_models/smollm2-135m
for file in config.json tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json generation_config.json; do
  [ -f "$source/$file" ] && cp "$source/$file" .gpu_models/smollm2-135m/
done
du -sh .whl .gpu_models
