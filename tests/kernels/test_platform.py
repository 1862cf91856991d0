"""The capability probe: ISA tiers from CPU flags, and forcing a lower tier."""

from __future__ import annotations

import pytest

from kernels import platform
from kernels.platform import TIER_FLAGS, active_tier, cpu_info, force_tier_environment, native_tier

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)

ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}


def test_tiers_follow_the_flags() -> None:
    assert native_tier("x86_64", ZEN3) == "avx2"
    assert native_tier("x86_64", ZEN4) == "avx512"
    # AVX-512 with VNNI but no BF16 (Cascade Lake, Ice Lake) has its own build; without VNNI (Skylake) AVX2's
    assert native_tier("x86_64", ZEN4 - {"avx512_bf16"}) == "avx512vnni"
    assert native_tier("x86_64", ZEN4 - {"avx512_bf16", "avx512_vnni"}) == "avx2"
    assert native_tier("x86_64", frozenset({"sse4_2"})) == "generic"
    assert native_tier("aarch64", frozenset({"asimd", "sve", "i8mm", "bf16"})) == "generic"


def test_this_machine_is_probed() -> None:
    info = cpu_info()
    assert info.cores >= 1 and info.model_name
    assert TIER_FLAGS[info.native_tier] <= info.flags
    assert platform.describe()["tier"] == active_tier()


def test_a_lower_tier_can_be_forced_but_not_a_higher_one(monkeypatch: pytest.MonkeyPatch) -> None:
    native = cpu_info().native_tier
    monkeypatch.setenv("FREIGHT_CPU_ISA", "generic")
    assert active_tier() == "generic"
    monkeypatch.setenv("FREIGHT_CPU_ISA", "native")
    assert active_tier() == native
    monkeypatch.setenv("FREIGHT_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        active_tier()
    if native != "avx512":
        monkeypatch.setenv("FREIGHT_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match="at most"):
            active_tier()


def test_forcing_avx2_limits_torch_onednn_and_mkl() -> None:
    env = force_tier_environment("avx2")
    assert env == {"FREIGHT_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # fmt: skip


@pytest.mark.parametrize(
    ("env", "allowed"),
    [
        ({}, True),
        ({"FREIGHT_CPU_AMX": "0"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False),  # the AVX-512 tier without AMX, emulated
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),  # what FREIGHT_CPU_ISA=avx2 sets
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    ],
)
def test_amx_is_allowed_unless_turned_off_or_capped(monkeypatch: pytest.MonkeyPatch, env, allowed) -> None:
    monkeypatch.delenv("FREIGHT_CPU_AMX", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert platform.amx_allowed() is allowed
