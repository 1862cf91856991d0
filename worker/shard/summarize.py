"""The summarize kind (the summarize job option): each document becomes one summary. A document that
fits the context is one request; a longer one is cut into overlapping token windows whose summaries
are reduced, level by level, into one (worker/map_reduce.py). Partial summaries are stored as they
finish (summary_parts), so a rerun shard resumes where the last attempt stopped. Each round of
requests is one engine stream; the row's prompt_tokens and output_tokens are the sums of all its
requests, windows and reduces included.

A row's override columns apply as in every kind (worker.shard.requests.sampling_for): temperature,
top_p and seed to each of its requests, max_tokens to the request that gives its summary (its partial
summaries keep the size the window plan was made for)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from storage.result_record import ResultRecord
from storage.status import FinishReason
from storage.summary_store import insert_parts, parts_of
from worker.attempt_meter import AttemptMeter
from worker.engine import SamplingParams
from worker.engine.outputs import RequestOutput
from worker.map_reduce import LongDocument, RequestKind, SummaryPrompts, SummaryRequest
from worker.result_writer import ChunkWriter
from worker.shard.requests import EngineRequest, custom_id, sampling_for
from worker.shard.run import ShardRun

log = logging.getLogger(__name__)


class PartWriter(ChunkWriter):
    """Buffers partial summaries and stores them in chunks (with the attempt's engine cost, as the
    result writer does); reads back what is stored."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        shard_index: int,
        chunk_rows: int,
        attempt: AttemptMeter | None = None,
    ) -> None:
        super().__init__(sessions, chunk_rows, attempt)
        self.job_id = job_id
        self.shard_index = shard_index

    def add(self, request: SummaryRequest, text: str, prompt_tokens: int, output_tokens: int) -> None:
        self._append(
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

    def _insert(self, session: Session, items: list[dict[str, Any]]) -> None:
        insert_parts(session, items, commit=False)

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


class SummarizeKind:
    name = "summarize"

    def run(self, run: ShardRun) -> int:
        """Summarize the documents in run.records; returns how many documents were sent to the engine.
        Stops early (rows left unwritten) when run.should_stop says so."""
        llm, params, records, writer = run.llm, run.params, run.records, run.writer
        spec = params.summarize
        tokenizer = llm.tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        def render_chat(content: str) -> str:
            return llm.apply_chat_template([{"role": "user", "content": content}])

        custom_ids = {index: custom_id(index, record) for index, record in records.items()}
        try:
            prompts = SummaryPrompts(encode, render_chat, spec, llm.max_model_len, params.max_tokens)
        except ValueError as exc:  # the instruction and max_tokens leave no room (a very long template)
            for index in records:
                writer.add(ResultRecord.failed(index, custom_ids[index], str(exc)))
            return 0
        budget = prompts.budget
        texts: dict[int, str] = {}
        for index, record in records.items():
            text = record.get(spec.column)
            if text is None or not str(text).strip():
                problem = "the document is empty" if text is not None else f"column {spec.column!r} is null"
                writer.add(ResultRecord.failed(index, custom_ids[index], problem))
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
                    SummaryRequest(
                        index, RequestKind.DOCUMENT, 0, 0, prompts.document(body), budget.max_tokens
                    )
                )
            else:
                long_documents[index] = LongDocument(index, ids)
        parts = PartWriter(run.sessions, run.job_id, run.shard_index, run.chunk_rows, run.meter)
        parts.load(long_documents)
        stop = _StopLatch(run.should_stop)
        while not stop.stopped:
            for document in long_documents.values():
                requests.extend(document.next_requests(prompts, encode))
            if not requests:
                break
            failed = _Round(run, long_documents, custom_ids, parts).run(requests, stop)
            parts.flush()
            finished = {
                request.row_index for request in requests if request.kind == RequestKind.FINAL
            } | failed
            for row_index in finished:
                long_documents.pop(row_index, None)
            requests = []
            if long_documents:
                parts.load(long_documents)
        return len(texts)


class _Round:
    """One round of requests in one engine stream: results go to the writer, partial summaries to the
    part writer."""

    def __init__(
        self,
        run: ShardRun,
        long_documents: dict[int, LongDocument],
        custom_ids: dict[int, str],
        parts: PartWriter,
    ) -> None:
        self.shard = run
        self.long_documents = long_documents
        self.custom_ids = custom_ids
        self.parts = parts
        self.failed: set[int] = set()  # long documents that failed (now error rows)

    def run(self, requests: list[SummaryRequest], stop: _StopLatch) -> set[int]:
        run = self.shard
        engine_requests = [
            EngineRequest(request.row_index, request.prompt_ids, self._sampling(request), request)
            for request in requests
        ]
        run.stream(engine_requests, self._output, should_stop=stop)
        return self.failed

    def _sampling(self, request: SummaryRequest) -> SamplingParams:
        run = self.shard
        return sampling_for(
            run.params,
            run.records[request.row_index],
            request.row_index,
            prompt_len=len(request.prompt_ids),
            max_model_len=run.llm.max_model_len,
            # The summary itself takes the row's max_tokens; partial summaries the plan's size.
            max_tokens=None if request.kind.gives_result else request.max_tokens,
            # Each request of a document draws its own numbers.
            seed_offset=1_000_003 * (request.level * 65_537 + request.part_index),
        )

    def _output(self, engine_request: EngineRequest[SummaryRequest], out: RequestOutput) -> None:
        request = engine_request.tag
        prompt_tokens, output_tokens = len(out.prompt_token_ids), len(out.output_token_ids)
        document = self.long_documents.get(request.row_index)
        if request.row_index in self.failed:
            return
        if not (request.kind.gives_result or out.error is not None):
            self.parts.add(request, out.text, prompt_tokens, output_tokens)
            return
        if document is not None:
            earlier_prompt, earlier_output = document.stored_tokens()
            prompt_tokens += earlier_prompt
            output_tokens += earlier_output
        error = out.error
        if error is not None and document is not None:
            error = f"{request.kind} {request.level}.{request.part_index} failed: {error}"
            self.failed.add(request.row_index)
        text = out.text if out.error is None else ""
        reason = out.finish_reason if out.error is None else FinishReason.ERROR.value
        self.shard.writer.add(
            ResultRecord(
                request.row_index,
                self.custom_ids[request.row_index],
                text,
                prompt_tokens,
                output_tokens,
                reason,
                error,
            )
        )
