"""The CPU KV pool's memory budget: what the engine was asked for, cut to what the machine has free.

On CUDA the pool is sized from the device's free memory (gpu_memory_utilization); on CPU from
`kv_cache_memory_gb`. A budget larger than the memory free once the model is loaded would swap or be killed
mid-job, long after the engine started, so it is cut at load to a share of what is free, and the engine says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

FREE_SHARE = 0.8  # of the memory free after the model loaded: the rest for activations, logits, the process


@dataclass(frozen=True)
class KVBudget:
    bytes: int  # what the pool may use
    asked_bytes: int
    free_bytes: int  # available memory when the pool was sized

    @property
    def cut(self) -> bool:
        return self.bytes < self.asked_bytes


def cpu_kv_budget(asked_gb: float) -> KVBudget:
    asked = int(asked_gb * 2**30)
    free = psutil.virtual_memory().available
    return KVBudget(bytes=min(asked, int(free * FREE_SHARE)), asked_bytes=asked, free_bytes=free)
