"""The plain kind: one request per row, its prompt from the job's template, column or chat messages.
Rows the tenant's result cache holds are written from it; only the others run (result_cache.py)."""

from __future__ import annotations

from storage.result_record import ResultRecord
from worker.engine.outputs import RequestOutput
from worker.shard.prompts import prepare_prompts
from worker.shard.requests import EngineRequest, custom_id, sampling_for
from worker.shard.result_cache import ShardResultCache
from worker.shard.run import ShardRun


class PlainKind:
    name = "plain"

    def run(self, run: ShardRun) -> int:
        llm = run.llm
        prepared = prepare_prompts(llm, run.source, run.params, run.records, run.writer.add)
        requests = [
            EngineRequest(
                row.row_index,
                row.prompt_ids,
                sampling_for(
                    run.params,
                    row.record,
                    row.row_index,
                    prompt_len=len(row.prompt_ids),
                    max_model_len=llm.max_model_len,
                ),
                custom_id(row.row_index, row.record),
            )
            for row in prepared
        ]
        cache = ShardResultCache(run)
        todo = cache.misses(requests)

        def write(request: EngineRequest[str], out: RequestOutput) -> None:
            run.writer.add(
                ResultRecord(
                    request.row_index,
                    request.tag,
                    out.text,
                    len(out.prompt_token_ids),
                    len(out.output_token_ids),
                    out.finish_reason,
                    out.error,
                )
            )
            cache.ran(request, out)

        if todo:
            run.stream(todo, write)
        run.writer.flush()  # the rows first: a cache entry never stands for a row that was not stored
        cache.remember()
        return len(todo)
