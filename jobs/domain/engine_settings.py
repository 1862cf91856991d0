"""The engine settings (FREIGHT_DTYPE, FREIGHT_MAX_NUM_SEQS, ...): derived from the engine's own options.

Every option of jobs.domain.engine_options.EngineOptions marked `setting` becomes a field of `EngineSettings` with the
option's name, type, default, description and bounds, so the worker settings, the engine's EngineConfig and
docs/configuration.md cannot disagree. `Settings` (settings.py) is built on this class; the worker hands
`engine_options_of(settings)` to the engine as they are.
"""

from __future__ import annotations

import typing
from dataclasses import fields

from pydantic import Field, create_model, field_validator
from pydantic_settings import BaseSettings

from jobs.domain.engine_options import EngineOptions, setting_names


def _fields() -> dict[str, typing.Any]:
    hints = typing.get_type_hints(EngineOptions)
    names = set(setting_names())
    return {
        spec.name: (hints[spec.name], Field(spec.default, description=spec.metadata["doc"], **spec.metadata["bounds"]))
        for spec in fields(EngineOptions)
        if spec.name in names
    }


class _EngineSettingsBase(BaseSettings):
    @field_validator("quantization", mode="before", check_fields=False)
    @classmethod
    def _none_means_off(cls, value: object) -> object:
        # FREIGHT_QUANTIZATION=none (or off, or empty) in the environment means no quantization
        return None if isinstance(value, str) and value.lower() in ("", "none", "off") else value


EngineSettings = create_model("EngineSettings", __base__=_EngineSettingsBase, **_fields())


def engine_options_of(settings: BaseSettings) -> dict[str, typing.Any]:
    """The engine options these settings set, by name (keyword arguments of EngineConfig / LLM)."""
    return {name: getattr(settings, name) for name in setting_names()}
