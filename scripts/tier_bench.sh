#!/usr/bin/env bash
# The same `freight bench` on this machine's native kernel build (with vLLM's CPU build in the same run), then
# on a lower tier's build forced, torch left at the machine's own capability, so the difference is our kernels.
#   MODEL=gemma3-270m N=64 LOWER=avx2 VLLM_PYTHON=/work/vllm-venv/bin/python bash scripts/tier_bench.sh
# VLLM_DTYPE=float32 (the default here) is vLLM's faster setting on a CPU without native BF16.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-smollm2-135m}
n=${N:-256}
lower=${LOWER:-avx2}
peer=(--systems freight)
if [ -n "${VLLM_PYTHON:-}" ]; then
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
  peer=(--systems freight,vllm --vllm-python "$VLLM_PYTHON" --vllm-dtype "${VLLM_DTYPE:-float32}")
fi
echo "== $model: native build ${VLLM_PYTHON:+and vLLM}"
.venv/bin/freight bench --model "$model" --n "$n" --output-len 128 "${peer[@]}"
echo "== $model: the $lower build forced"
capability=$(.venv/bin/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability().lower())')
FREIGHT_CPU_ISA=$lower ATEN_CPU_CAPABILITY=$capability ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-ALL} \
  MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-AVX512} \
  .venv/bin/freight bench --model "$model" --n "$n" --output-len 128 --systems freight
