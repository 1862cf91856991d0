"""What the engine runs on this machine, op by op, and why: made once at load (make.py), then only read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import cpu_decode_attention, cpu_int8_linear, cpu_int8_small_batch, cpu_prefill_attention
from worker.engine.config import DTYPES
from worker.engine.plan.attention import AttentionChoice
from worker.engine.plan.schemes import Scheme
from worker.engine.plan.small_batch import SmallBatchChoice


@dataclass(frozen=True)
class ExecutionPlan:
    """Every per-op choice, with the measured seconds behind it (freight doctor, bench JSON, job metrics)."""

    tier: str  # the ISA tier the kernels run, or "cuda"
    scheme: Scheme  # compute dtype and the path of every linear (float GEMM or which W8A8 GEMM)
    head_dim: int
    source: str  # of the scheme: "measured", "cache" or "fixed" (CUDA, or nothing left to choose)
    seconds_per_token: dict[str, float] = field(default_factory=dict)  # scheme name -> model-level cost
    best: str | None = None  # the fastest scheme measured
    attention: AttentionChoice | None = None  # CPU: compiled kernel or torch, per attention op (measured)
    small_batch: SmallBatchChoice | None = None  # CPU INT8 with small_batch_rows="auto": the measurement
    small_batch_rows: int = 0  # INT8 products of at most this many rows take the small-batch kernel
    invariant_rows: int = 0  # float products run in blocks of this many rows (0: no blocks; invariance.py)
    wide_rows: tuple[int, ...] = ()  # wider blocks that round like invariant_rows' ones

    def paths(self) -> dict[str, str]:
        """The path each op takes, by name (freight doctor, bench JSON, job metrics)."""
        s = self.scheme
        if s.quantization == "int8":
            gemm = {"int_mm": "W8A8 torch._int_mm (s8 x s8)", "onednn": "W8A8 oneDNN qlinear (u8 x s8)",
                    "amx": "W8A8 own AMX tile GEMM (s8 x s8, fused epilogue)",
                    "triton": "W8A8 Triton int8 GEMM"}[s.int8_backend or "int_mm"]  # fmt: skip
            quantize = "compiled per-token quantization" if cpu_int8_linear.available() else "torch"
            if s.int8_backend == "amx" and s.dtype == "bfloat16" and cpu_int8_linear.available():
                quantize += ", fused with the RMSNorm before q/k/v and gate/up"  # AmxInt8Linear.normed
            if self.small_batch is not None and self.small_batch.rows:
                tiles = ", AMX tiles" if cpu_int8_small_batch.amx_enabled() else ""
                # the layout most weights take (a K not a multiple of 4 keeps rows: default_layout)
                panels = ", VNNI panels" if cpu_int8_small_batch.panels_available() and not tiles else ""
                gemm += (
                    f"; up to {self.small_batch.rows} rows: own weight-streaming int8 product ({self.tier}{tiles}{panels})"
                )
        else:
            gemm, quantize = f"{s.dtype} GEMM", "none"
        if self.tier == "cuda":
            return {"dtype": s.dtype, "projections": gemm, "lm_head": gemm, "decode_attention": "triton",
                    "prefill_attention": "triton", "activation_quantization": "triton" if s.quantization else "none",
                    "epilogues": "triton"}  # fmt: skip
        return {
            "dtype": s.dtype,
            "projections": gemm,
            "lm_head": gemm,
            "decode_attention": f"compiled ({self.tier})" if self._compiled("decode") else "torch (gather + matmul)",
            "prefill_attention": self._prefill_attention_path(),
            "activation_quantization": quantize,
            "epilogues": f"compiled fused ({self.tier})" if s.quantization and cpu_int8_linear.available() else "torch",
        }  # fmt: skip

    def _prefill_attention_path(self) -> str:
        # the same test the dispatch makes (kernels/prefill_attention.py), on a one-token stand-in
        query = torch.empty(1, 1, self.head_dim, dtype=DTYPES[self.scheme.dtype])
        if self._compiled("prefill") and cpu_prefill_attention.supports(query, query):
            amx = self.scheme.dtype == "bfloat16" and cpu_prefill_attention.amx_enabled()
            unit = "AMX tiles" if amx else self.tier
            return f"compiled flash attention ({unit}, {self.scheme.dtype}), cached prefixes included"
        return "torch SDPA per sequence"

    def _compiled(self, op: str) -> bool:
        if self.attention is not None:
            return self.attention.compiled_decode if op == "decode" else self.attention.compiled_prefill
        return op != "decode" or cpu_decode_attention.available()

    def to_json(self) -> dict[str, object]:
        attention = None if self.attention is None else self.attention.seconds
        small = None if self.small_batch is None else {"rows": self.small_batch.rows, "seconds": self.small_batch.seconds}
        return {"tier": self.tier, "scheme": self.scheme.name, "source": self.source, "best": self.best,
                "seconds_per_token": self.seconds_per_token, "attention_seconds": attention,
                "small_batch": small, "small_batch_rows": self.small_batch_rows,
                "invariant_rows": self.invariant_rows, "wide_rows": list(self.wide_rows),
                "paths": self.paths()}  # fmt: skip
