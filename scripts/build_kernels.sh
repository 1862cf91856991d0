#!/usr/bin/env bash
# Builds the compiled CPU kernels of the active ISA tier (FREIGHT_CPU_ISA forces one) in one process per
# kernel, so that the compiles run side by side, then prints the tier and what was built. A kernel that
# fails to build is reported False (the engine then uses the torch path); its build log is on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
for kernel in "cpu_decode_attention.available()" "cpu_int8_linear.available()" \
              "cpu_int8_small_batch.available()" "cpu_int8_gemm_amx.load_extension()" \
              "cpu_prefill_attention.available(torch.float32)" \
              "cpu_prefill_attention.available(torch.bfloat16)"; do
  .venv/bin/python -c "import torch
from kernels import cpu_decode_attention, cpu_int8_gemm_amx, cpu_int8_linear, cpu_int8_small_batch, cpu_prefill_attention
$kernel" &
done
wait
.venv/bin/python -c "
import torch
from kernels import cpu_decode_attention, cpu_int8_gemm_amx, cpu_int8_linear, cpu_int8_small_batch, cpu_prefill_attention
from kernels.platform import tier_line
print(tier_line())
print('CPU kernels built: decode attention', cpu_decode_attention.available(),
      '| int8 linear', cpu_int8_linear.available(), '| int8 small batch', cpu_int8_small_batch.available(),
      '| int8 AMX GEMM', cpu_int8_gemm_amx.available(),
      '| prefill attention float32', cpu_prefill_attention.available(torch.float32),
      'bfloat16', cpu_prefill_attention.available(torch.bfloat16))"
