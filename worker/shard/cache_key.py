"""The one key of the result cache: a digest of everything a row's output depends on, computed where
its prompt is tokenized. The model revision and numerics (worker/engine/identity.py: the model files,
dtype, quantization, KV dtype, batch-invariant mode, kernels' paths), the prompt's token ids after the
template, and the request's whole sampling (max_tokens, temperature, top_p, top_k, seed, stop strings,
constraint, ...). The tenant is not in it: the cache table keeps tenants apart by its own column."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict

from worker.engine import SamplingParams
from worker.engine.identity import NumericsIdentity

# Bumped when what goes into the key changes, so old entries stop matching instead of matching wrongly.
KEY_VERSION = 1


def result_key(numerics: NumericsIdentity, prompt_ids: Sequence[int], sampling: SamplingParams) -> str:
    payload = {
        "version": KEY_VERSION,
        "numerics": numerics.as_dict(),
        "prompt_ids": [int(token) for token in prompt_ids],
        "sampling": asdict(sampling),  # a constraint's choice tuple becomes a list: same text either way
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()
