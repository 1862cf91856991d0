"""The user-facing entry point, shaped like vLLM's offline `LLM`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from worker.engine.chat import apply_chat_template
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.identity import NumericsIdentity
from worker.engine.outputs import EngineStats, RequestOutput
from worker.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "smollm2-135m", *, engine_thread: bool = False, **options) -> None:
        """engine_thread: build the engine and run every step on one dedicated thread, whichever thread
        calls. For callers whose threads change (a worker that loads on its main thread and runs jobs on
        pool threads): OpenMP keeps a thread team per calling thread, and with more team threads than
        cores libgomp stops spinning between parallel regions, which measured 25% slower here."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="freight-engine") if engine_thread else None
        self.config = EngineConfig(model=model, **options)
        self.engine = self._on_engine_thread(LLMEngine, self.config)

    def _on_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None or threading.current_thread().name.startswith("freight-engine"):
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        """Stop the engine thread, if any (the engine itself is freed with this object)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def numerics(self) -> NumericsIdentity:
        """The model revision and numerics this engine runs (worker/engine/identity.py)."""
        return self.engine.numerics

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return apply_chat_template(self.tokenizer, messages)

    def encode(self, prompt: Prompt, *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """All outputs, in input order."""
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for out in self.stream(prompts, params, use_tqdm=use_tqdm):
            outputs[out.index] = out
        return outputs  # type: ignore[return-value]

    def chat(
        self,
        conversations: Sequence[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        # the template already holds the special tokens; adding BOS again would double it
        ids = [self.encode(self.apply_chat_template(c), add_special_tokens=False) for c in conversations]
        return self.generate(ids, params, use_tqdm=use_tqdm)

    def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        should_cancel: Callable[[], bool] | None = None,
        cancel_poll_seconds: float = 1.0,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output as soon as it finishes.

        should_cancel is polled between steps, at most every cancel_poll_seconds; when it returns True the
        unfinished requests are dropped and the stream ends.
        """
        per_request = _expand_params(params, len(prompts))
        for index, (prompt, p) in enumerate(zip(prompts, per_request, strict=True)):
            self.engine.add_request(index, self.encode(prompt), p)
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not use_tqdm)
        started, tokens_at_start = time.monotonic(), self.stats.output_tokens + self.stats.prompt_tokens
        last_poll = time.monotonic()
        try:
            while self.engine.has_unfinished():
                if should_cancel and time.monotonic() - last_poll >= cancel_poll_seconds:
                    last_poll = time.monotonic()
                    if should_cancel():
                        self.engine.abort_all()
                        return
                finished = self._on_engine_thread(self.engine.step)
                if finished and use_tqdm:
                    done_tokens = self.stats.output_tokens + self.stats.prompt_tokens - tokens_at_start
                    bar.set_postfix(tok_s=f"{done_tokens / max(time.monotonic() - started, 1e-9):.0f}")
                    bar.update(len(finished))
                for seq in finished:
                    yield self.engine.to_output(seq)
        finally:
            bar.close()
            if self.engine.has_unfinished():  # the caller stopped iterating early
                self.engine.abort_all()


def _expand_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one or one per prompt")
    return list(params)
