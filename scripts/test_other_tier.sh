#!/usr/bin/env bash
# On an AVX-512 machine: the engine and kernel tests once more with the AVX2 tier forced (our kernels, torch,
# oneDNN and MKL all limited to AVX2), so the other tier's fast paths are tested on this machine too. It
# builds the AVX2 kernels first (minutes on 2 cores), so it is not part of the README's test command;
# .ci/run calls it when FREIGHT_CI_OTHER_TIER=1. On an AVX2 machine there is no other tier to force.
set -euo pipefail
cd "$(dirname "$0")/.."
native_tier=$(.venv/bin/python -c 'from kernels.platform import cpu_info; print(cpu_info().native_tier)')
if [ "$native_tier" != "avx512" ] && [ "$native_tier" != "avx512vnni" ]; then
  echo "native tier is $native_tier: nothing to force"
  exit 0
fi
echo "== engine and kernel tests with the AVX2 tier forced =="
export FREIGHT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
bash scripts/build_kernels.sh  # the AVX2 builds side by side, not one by one inside the tests
# the model conversion and the Triton interpreter run no ISA-specific code: the first pass covered them
bash scripts/test.sh tests/worker/engine tests/kernels \
  --deselect tests/worker/engine/test_loader.py::test_gguf_path_converts_once_into_the_cache \
  --deselect tests/kernels/test_triton_subprocess.py "$@"
