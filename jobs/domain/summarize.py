"""The `summarize` task's planning: check what a user asks for (document column, style or template, how
to treat long documents) and resolve it into a SummarizeSpec (jobs/domain/summarize_spec.py), and check
the input file against it. The worker (worker/map_reduce.py) turns documents into token windows and
reduce requests."""

from __future__ import annotations

from typing import Any

from jobs.domain.errors import InputError
from jobs.domain.prompts import template_fields
from jobs.domain.schemas import JobParams
from jobs.domain.summarize_spec import DEFAULT_COLUMN, DEFAULT_STYLE, TEXT_PLACEHOLDER, SummarizeSpec
from jobs.domain.validation import open_parquet
from storage.arrow_path import ParquetSource

SUMMARIZE_ONLY_FIELDS = ("column", "style", "long_documents", "id_column")


def resolve_summarize(params: JobParams, max_model_len: int) -> SummarizeSpec:
    """Check a summarize job's parameters and fill in the defaults, or raise InputError."""
    if params.template is not None and params.style is not None:
        raise InputError("give either style or template for a summarize job, not both", field="template")
    if params.prompt_column is not None:
        raise InputError(
            "a summarize job reads its documents from `column`, not `prompt_column`", field="prompt_column"
        )
    if params.template is not None:
        fields = template_fields(params.template)
        if fields != ["text"]:
            raise InputError(
                f"a summarize template must use exactly one placeholder, {TEXT_PLACEHOLDER} (the document "
                f"or a part of it); it uses {['{' + name + '}' for name in fields]}",
                field="template",
            )
    # map_reduce: two partial summaries must fit in one reduce request next to the output, with room
    # to spare. truncate: at least half the context is left for the document.
    share, words = (4, "a quarter") if params.long_documents == "map_reduce" else (2, "half")
    if params.max_tokens > max_model_len // share:
        raise InputError(
            f"max_tokens is {params.max_tokens}; with long_documents {params.long_documents!r} it must be at "
            f"most {words} of the model context ({max_model_len // share} of {max_model_len} tokens)",
            field="max_tokens",
        )
    return SummarizeSpec(
        column=params.column or DEFAULT_COLUMN,
        style=params.style or DEFAULT_STYLE,
        template=params.template,
        long_documents=params.long_documents,
        id_column=params.id_column,
    )


def task_fields(params: JobParams, max_model_len: int) -> dict[str, Any]:
    """ResolvedParams fields that depend on the task. A summarize job reads its documents as the
    prompt column (so validation and sharding measure them) and always uses the chat template."""
    if params.task != "summarize":
        stray = [name for name in SUMMARIZE_ONLY_FIELDS if name in params.model_fields_set]
        if stray:
            raise InputError(f"{stray[0]} applies only to task 'summarize'", field=stray[0])
        return {"task": "generate", "summarize": None}
    spec = resolve_summarize(params, max_model_len)
    return {
        "task": "summarize",
        "summarize": spec,
        "template": None,
        "prompt_column": spec.column,
        "chat": True,
    }


def check_summarize_file(source: ParquetSource, spec: SummarizeSpec) -> None:
    """The document column and a named id column must exist (their types are checked with the prompts)."""
    names = open_parquet(source).schema_arrow.names
    if spec.column not in names:
        raise InputError(
            f"column {spec.column!r} (the documents) is not in the file (columns: {names}); "
            "name the document column with `column`",
            column=spec.column,
        )
    if spec.id_column is not None and spec.id_column not in names:
        raise InputError(
            f"id_column {spec.id_column!r} is not in the file (columns: {names})", column=spec.id_column
        )
