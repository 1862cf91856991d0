"""Freight's inference engine: continuous batching over a paged INT8 KV cache, INT8 weights."""

from worker.engine.config import EngineConfig, ModelConfig
from worker.engine.llm import LLM
from worker.engine.outputs import EngineStats, RequestOutput, RequestTimings
from worker.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineStats", "ModelConfig", "RequestOutput", "RequestTimings", "SamplingParams"]
