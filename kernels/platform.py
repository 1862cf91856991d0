"""What machine this is: CPU ISA tier and extensions, cores, caches, torch's CPU capability, CUDA.

The ISA tier names the compiled-kernel build that runs here (kernels/_cpu_build.py compiles each kernel
for named ISA levels, never -march=native, so a build made on one machine runs on another):

- `avx512`: AVX-512 F/BW/VL/DQ with VNNI and BF16 (Zen 4, Sapphire Rapids and later);
- `avx512vnni`: the same without BF16 (Cascade Lake, Ice Lake: many cloud servers); the INT8 kernels run
  at AVX-512 width, the BF16-only kernels (bf16 prefill attention) are not built;
- `avx2`: AVX2 + FMA + F16C (Haswell and later, Zen 1-3; also AVX-512 CPUs without VNNI, e.g. Skylake);
- `generic`: anything else, aarch64 included (portable C++ loops, vectorized by the compiler).

FREIGHT_CPU_ISA=avx2 (or generic) forces a lower tier on a machine that has a higher one, to test what
another machine runs; `force_tier_environment` sets the matching knobs for torch, oneDNN and MKL.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

TIERS = ("generic", "avx2", "avx512vnni", "avx512")  # lowest first
TIER_FLAGS: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                         "avx512_bf16"}),
}  # fmt: skip
# What torch (ATen), oneDNN and MKL are told when a lower tier is forced, so library paths run as there.
TIER_LIBRARY_ENV: dict[str, dict[str, str]] = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512vnni": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512": {},
}
ISA_ENV = "FREIGHT_CPU_ISA"
# Extensions worth naming in a report; /proc/cpuinfo spells them these ways (x86 "flags", arm "Features").
REPORTED_EXTENSIONS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                       "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve", "i8mm", "bf16")  # fmt: skip


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model_name: str
    flags: frozenset[str]
    cores: int  # usable by this process (affinity)
    caches: dict[str, str] = field(default_factory=dict)  # "L1d": "32K", "L2": "512K", ...

    @property
    def native_tier(self) -> str:
        return native_tier(self.arch, self.flags)

    @property
    def has_vnni(self) -> bool:
        """u8 x s8 dot products without int16 saturation (oneDNN's int8 GEMMs need it for full-range weights)."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & self.flags)

    @property
    def has_native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or (self.arch == "aarch64" and "bf16" in self.flags)

    @property
    def extensions(self) -> list[str]:
        return [name for name in REPORTED_EXTENSIONS if name in self.flags]


def native_tier(arch: str, flags: frozenset[str]) -> str:
    if arch not in ("x86_64", "AMD64"):
        return "generic"
    return next(tier for tier in reversed(TIERS) if TIER_FLAGS[tier] <= flags)


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", frozenset()
    model, flags = "unknown", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "CPU part") and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def _read_caches() -> dict[str, str]:
    caches: dict[str, str] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[f"L{level}{suffix}"] = size
    return caches


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = _read_cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CpuInfo(arch=platform.machine(), model_name=model, flags=flags, cores=cores, caches=_read_caches())


def active_tier() -> str:
    """The tier whose kernels run: FREIGHT_CPU_ISA when set (it may only lower the native tier)."""
    native = cpu_info().native_tier
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced or forced == "native":
        return native
    if forced not in TIERS:
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(TIERS)} or native")
    if TIERS.index(forced) > TIERS.index(native):
        raise ValueError(f"{ISA_ENV}={forced}: this CPU runs at most the {native} tier")
    return forced


def force_tier_environment(tier: str) -> dict[str, str]:
    """The environment that makes torch, oneDNN and MKL behave as on a `tier` machine (set it before torch
    is imported: ATen reads ATEN_CPU_CAPABILITY once)."""
    return {ISA_ENV: tier, **TIER_LIBRARY_ENV[tier]}


def apply_forced_tier_environment() -> None:
    """When FREIGHT_CPU_ISA forces a tier, give torch, oneDNN and MKL its limits too (unless set already).
    Runs when `kernels` is imported: each library reads its variable once, at its first use."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced in TIER_LIBRARY_ENV:
        for name, value in TIER_LIBRARY_ENV[forced].items():
            os.environ.setdefault(name, value)


@dataclass(frozen=True)
class CudaInfo:
    name: str
    capability: str  # "9.0"
    memory_gb: float


def cuda_info() -> CudaInfo | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return CudaInfo(name=props.name, capability=f"{props.major}.{props.minor}", memory_gb=props.total_memory / 2**30)


def describe() -> dict[str, object]:
    """The machine as JSON-ready fields (freight doctor, bench output, job metrics)."""
    import torch

    info = cpu_info()
    cuda = cuda_info()
    return {
        "arch": info.arch,
        "cpu": info.model_name,
        "tier": active_tier(),
        "native_tier": info.native_tier,
        "extensions": info.extensions,
        "cores": info.cores,
        "threads": torch.get_num_threads(),
        "caches": info.caches,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": None if cuda is None else {"name": cuda.name, "capability": cuda.capability,
                                           "memory_gb": round(cuda.memory_gb, 1)},
    }  # fmt: skip


def tier_line() -> str:
    """One line naming the machine, for logs, benchmark output and the top of a test run."""
    import torch

    info = cpu_info()
    tier = active_tier()
    forced = f" (forced; native {info.native_tier})" if tier != info.native_tier else ""
    return (f"CPU tier {tier}{forced}: {info.model_name}, {info.cores} cores, {' '.join(info.extensions) or '-'}; "
            f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip


AMX_ENV = "FREIGHT_CPU_AMX"


def amx_allowed() -> bool:
    """Whether Freight's kernels may use AMX tiles where the CPU has them: unless FREIGHT_CPU_AMX=0, or
    ONEDNN_MAX_CPU_ISA caps oneDNN below AMX (a capped run, e.g. the AVX-512-without-AMX tier emulated on an
    AMX machine, keeps every path below AMX alike)."""
    if os.environ.get(AMX_ENV, "1") == "0":
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return cap in ("ALL", "DEFAULT") or "AMX" in cap
