"""The `summarize` task's resolved settings (SummarizeSpec) and the instructions each request gets.
Pure data, shared by the API, the worker and the job parameters (jobs/domain/schemas.py); the
planning that builds a SummarizeSpec from job parameters is in jobs/domain/summarize.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

LongDocuments = Literal["map_reduce", "truncate"]
DEFAULT_COLUMN = "text"
DEFAULT_STYLE = "one paragraph"
ID_COLUMN_CANDIDATES = ("custom_id", "id", "doc_id", "document_id")
WINDOW_OVERLAP_TOKENS = 64  # consecutive windows share this many tokens so no sentence is lost at a cut
TEXT_PLACEHOLDER = "{text}"


class SummarizeSpec(BaseModel):
    """A summarize job's resolved settings (stored with the job's params)."""

    column: str
    style: str
    template: str | None  # the user's instruction with a {text} placeholder, if given
    long_documents: LongDocuments
    id_column: str | None  # input column copied to the output as the document's id

    def document_instruction(self) -> str:
        if self.template is not None:
            return self.template
        return f"Summarize the following document. Write the summary as {self.style}.\n\n{TEXT_PLACEHOLDER}"

    def window_instruction(self, part: int, parts: int) -> str:
        """Instruction for window `part` (1-based) of `parts`; partial summaries stay plain prose."""
        if self.template is not None:
            return self.template
        return (
            f"The following text is part {part} of {parts} of a longer document. "
            f"Summarize this part in a few sentences.\n\n{TEXT_PLACEHOLDER}"
        )

    def reduce_instruction(self) -> str:
        if self.template is not None:
            return self.template
        return (
            "The following are summaries of consecutive parts of one document, in order. Combine them "
            f"into one summary of the whole document. Write the summary as {self.style}.\n\n{TEXT_PLACEHOLDER}"
        )


def output_id_column(names: list[str], spec: SummarizeSpec) -> str | None:
    """The input column kept in the output as the document's id: the one named, else the first usual one."""
    if spec.id_column is not None:
        return spec.id_column
    return next((name for name in ID_COLUMN_CANDIDATES if name in names), None)
