"""Run a summarize shard on the engine: documents that fit are one request each; long documents go
through map-reduce (worker/map_reduce.py). Each round streams every request the shard's documents
need next (short documents and the windows of long ones batch together in the first round), stores
partial summaries as they finish, and writes a document's result row once its summary is done.
A document's result row counts the tokens of all its requests, windows and reduces included."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import closing
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.schemas import ResolvedParams
from storage.status import FinishReason
from storage.summary_store import insert_parts, parts_of
from worker.attempt_meter import AttemptMeter
from worker.engine import LLM, SamplingParams
from worker.map_reduce import LongDocument, RequestKind, SummaryPrompts, SummaryRequest
from worker.result_writer import ResultWriter

log = logging.getLogger(__name__)


class PartWriter:
    """Buffers partial summaries and stores them in chunks; reads back what is stored."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        shard_index: int,
        chunk_rows: int,
        attempt: AttemptMeter | None = None,
    ) -> None:
        self.sessions = sessions
        self.job_id = job_id
        self.shard_index = shard_index
        self.chunk_rows = chunk_rows
        self.attempt = attempt  # the parts' engine cost is stored with them (see ResultWriter.flush)
        self.pending: list[dict[str, Any]] = []

    def add(self, request: SummaryRequest, text: str, prompt_tokens: int, output_tokens: int) -> None:
        self.pending.append(
            {
                "job_id": self.job_id,
                "row_index": request.row_index,
                "level": request.level,
                "part_index": request.part_index,
                "text": text,
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "shard_index": self.shard_index,
            }
        )
        if len(self.pending) >= self.chunk_rows:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            with self.sessions() as session:
                insert_parts(session, self.pending, commit=False)
                if self.attempt is not None:
                    self.attempt.record(session, commit=False)
                session.commit()
            self.pending.clear()

    def load(self, documents: dict[int, LongDocument]) -> None:
        """Replace each document's parts with the stored ones (the first stored copy wins)."""
        with self.sessions() as session:
            stored = parts_of(session, self.job_id, sorted(documents))
        for row_index, document in documents.items():
            document.parts = stored.get(row_index, {})


class _StopLatch:
    """Remembers that the stop check once said yes, so later rounds do not start."""

    def __init__(self, check: Callable[[], bool]) -> None:
        self.check = check
        self.stopped = False

    def __call__(self) -> bool:
        self.stopped = self.stopped or self.check()
        return self.stopped


def summarize_rows(
    llm: LLM,
    params: ResolvedParams,
    records: dict[int, dict[str, Any]],
    writer: ResultWriter,
    parts: PartWriter,
    should_cancel: Callable[[], bool],
    cancel_poll_seconds: float,
) -> int:
    """Summarize the documents in `records` ({row_index: input row}); returns how many documents
    were sent to the engine. Stops early (rows left unwritten) when `should_cancel` says so."""
    spec = params.summarize
    tokenizer = llm.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def render_chat(content: str) -> str:
        return llm.apply_chat_template([{"role": "user", "content": content}])

    custom_ids = {index: _custom_id(index, record) for index, record in records.items()}
    try:
        prompts = SummaryPrompts(encode, render_chat, spec, llm.max_model_len, params.max_tokens)
    except ValueError as exc:  # the instruction and max_tokens leave no room (a very long template)
        for index in records:
            writer.add(_row(index, custom_ids[index], "", 0, 0, FinishReason.ERROR.value, str(exc)))
        return 0
    budget = prompts.budget
    texts: dict[int, str] = {}
    for index, record in records.items():
        text = record.get(spec.column)
        if text is None or not str(text).strip():
            problem = "the document is empty" if text is not None else f"column {spec.column!r} is null"
            writer.add(_row(index, custom_ids[index], "", 0, 0, FinishReason.ERROR.value, problem))
        else:
            texts[index] = str(text)
    if not texts:
        return 0
    order = sorted(texts)
    encoded = tokenizer([texts[index] for index in order], add_special_tokens=False)["input_ids"]
    requests: list[SummaryRequest] = []
    long_documents: dict[int, LongDocument] = {}
    for index, ids in zip(order, encoded, strict=True):
        if len(ids) <= budget.document_input_tokens or spec.long_documents == "truncate":
            body = ids[: budget.document_input_tokens]
            requests.append(
                SummaryRequest(index, RequestKind.DOCUMENT, 0, 0, prompts.document(body), budget.max_tokens)
            )
        else:
            long_documents[index] = LongDocument(index, ids)
    parts.load(long_documents)
    stop = _StopLatch(should_cancel)
    while not stop.stopped:
        for document in long_documents.values():
            requests.extend(document.next_requests(prompts, encode))
        if not requests:
            break
        failed = _run_round(
            llm, params, requests, long_documents, custom_ids, writer, parts, stop, cancel_poll_seconds
        )
        parts.flush()
        finished = {request.row_index for request in requests if request.kind == RequestKind.FINAL} | failed
        for row_index in finished:
            long_documents.pop(row_index, None)
        requests = []
        if long_documents:
            parts.load(long_documents)
    return len(texts)


def _run_round(
    llm: LLM,
    params: ResolvedParams,
    requests: list[SummaryRequest],
    long_documents: dict[int, LongDocument],
    custom_ids: dict[int, str],
    writer: ResultWriter,
    parts: PartWriter,
    stop: _StopLatch,
    cancel_poll_seconds: float,
) -> set[int]:
    """Stream one round of requests; returns the long documents that failed (now error rows)."""
    requests.sort(key=lambda request: len(request.prompt_ids))  # similar lengths run together
    sampling = [_sampling(params, request, llm.max_model_len) for request in requests]
    failed: set[int] = set()
    stream = llm.stream(
        [request.prompt_ids for request in requests],
        sampling,
        should_cancel=stop,
        cancel_poll_seconds=cancel_poll_seconds,
    )
    # Closed while this shard holds the engine (see shard_runner._generate).
    with closing(stream):
        for out in stream:
            request = requests[out.index]
            prompt_tokens, output_tokens = len(out.prompt_token_ids), len(out.output_token_ids)
            document = long_documents.get(request.row_index)
            if request.row_index in failed:
                continue
            if request.kind.gives_result or out.error is not None:
                if document is not None:
                    earlier_prompt, earlier_output = document.stored_tokens()
                    prompt_tokens += earlier_prompt
                    output_tokens += earlier_output
                error = out.error
                if error is not None and document is not None:
                    error = f"{request.kind} {request.level}.{request.part_index} failed: {error}"
                    failed.add(request.row_index)
                text = out.text if out.error is None else ""
                reason = out.finish_reason if out.error is None else FinishReason.ERROR.value
                writer.add(
                    _row(
                        request.row_index,
                        custom_ids[request.row_index],
                        text,
                        prompt_tokens,
                        output_tokens,
                        reason,
                        error,
                    )
                )
            else:
                parts.add(request, out.text, prompt_tokens, output_tokens)
    return failed


def _sampling(params: ResolvedParams, request: SummaryRequest, max_model_len: int) -> SamplingParams:
    seed = None
    if params.seed is not None:
        # Reproducible, and each request of a document draws its own numbers.
        seed = params.seed + request.row_index + 1_000_003 * (request.level * 65_537 + request.part_index)
    return SamplingParams(
        max_tokens=max(1, min(request.max_tokens, max_model_len - len(request.prompt_ids))),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        stop=list(params.stop),
    )


def _custom_id(index: int, record: dict[str, Any]) -> str:
    value = record.get("custom_id")
    return str(index) if value is None else value


def _row(
    index: int,
    custom_id: str,
    text: str,
    prompt_tokens: int,
    output_tokens: int,
    finish_reason: str,
    error: str | None,
) -> dict[str, Any]:
    return {
        "row_index": index,
        "custom_id": custom_id,
        "output_text": text,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "finish_reason": finish_reason,
        "error": error,
    }
