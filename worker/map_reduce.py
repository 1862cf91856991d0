"""Map-reduce over long documents, as plain planning (no engine, no database): the token budget of each
kind of request, the windows a document is cut into, how partial summaries are grouped for reduce,
and which requests a document needs next given the parts already stored.

A document that fits is one request. A longer one is cut into overlapping token windows (level 0);
the window summaries are packed, in order, into groups that fit one reduce request; while more than
one group is needed, each group is summarized into a level-1 part, and so on. Every partial summary
is cut to half a reduce request's input, so each group holds at least two parts and every level at
least halves the count: the depth is about log2(windows). The plan depends only on the document and
the stored parts, so a redelivered shard recomputes the same plan and runs only what is missing."""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from jobs.domain.summarize_spec import WINDOW_OVERLAP_TOKENS, SummarizeSpec
from storage.summary_store import PartKey, StoredPart

PLACEHOLDER_MARK = "\ue000"  # a private-use character: never in the chat template itself
PART_SEPARATOR = "\n\n"


class RequestKind(StrEnum):
    DOCUMENT = "document"  # the whole (or truncated) document: its result is the summary
    WINDOW = "window"  # level 0: one window of a long document
    REDUCE = "reduce"  # level n > 0: one group of level n - 1 summaries
    FINAL = "final"  # all remaining summaries into the document's summary

    @property
    def gives_result(self) -> bool:
        return self in (RequestKind.DOCUMENT, RequestKind.FINAL)


@dataclass(frozen=True)
class SummaryRequest:
    row_index: int
    kind: RequestKind
    level: int
    part_index: int
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Budget:
    """Token budgets, all within the model's context."""

    max_model_len: int
    max_tokens: int  # the final summary
    part_max_tokens: int  # each partial summary
    window_tokens: int  # document tokens per window
    overlap: int  # tokens shared by consecutive windows
    reduce_input_tokens: int  # summary tokens one reduce request holds
    document_input_tokens: int  # document tokens a single request holds


def frame_pieces(instruction: str) -> tuple[str, str]:
    """The literal text before and after the instruction's first {text} placeholder (escapes undone)."""
    before: list[str] = []
    after: list[str] = []
    target = before
    for literal, name, _spec, _conversion in string.Formatter().parse(instruction):
        target.append(literal)
        if name is not None:
            if target is before and name == "text":
                target = after
            else:
                target.append("{" + name + "}")
    return "".join(before), "".join(after)


class SummaryPrompts:
    """Prompt token ids: the instruction in the chat template, split around the body, each half
    tokenized once; a body (document tokens or joined summaries) goes between them unchanged."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        render_chat: Callable[[str], str],
        spec: SummarizeSpec,
        max_model_len: int,
        max_tokens: int,
    ) -> None:
        self.encode = encode
        self.render_chat = render_chat
        self.spec = spec
        self._frames: dict[str, tuple[list[int], list[int]]] = {}
        self.separator_ids = encode(PART_SEPARATOR)
        self.budget = self._budget(max_model_len, max_tokens)

    def _frame(self, instruction: str) -> tuple[list[int], list[int]]:
        if instruction not in self._frames:
            before, after = frame_pieces(instruction)
            head, tail = self.render_chat(before + PLACEHOLDER_MARK + after).split(PLACEHOLDER_MARK, 1)
            self._frames[instruction] = (self.encode(head), self.encode(tail))
        return self._frames[instruction]

    def _overhead(self, instruction: str) -> int:
        head, tail = self._frame(instruction)
        return len(head) + len(tail)

    def _budget(self, max_model_len: int, max_tokens: int) -> Budget:
        reduce_input = max_model_len - max_tokens - self._overhead(self.spec.reduce_instruction())
        part_max_tokens = min(max_tokens, (reduce_input - len(self.separator_ids)) // 2)
        widest = self.spec.window_instruction(99999, 99999)  # the most digits a part number takes
        window_tokens = max_model_len - part_max_tokens - self._overhead(widest)
        document_input = max_model_len - max_tokens - self._overhead(self.spec.document_instruction())
        if part_max_tokens < 1 or window_tokens <= WINDOW_OVERLAP_TOKENS // 4 or document_input < 1:
            raise ValueError(
                f"max_tokens {max_tokens} and the instruction leave no room for the document in a "
                f"context of {max_model_len} tokens"
            )
        return Budget(
            max_model_len=max_model_len,
            max_tokens=max_tokens,
            part_max_tokens=part_max_tokens,
            window_tokens=window_tokens,
            overlap=min(WINDOW_OVERLAP_TOKENS, window_tokens // 4),
            reduce_input_tokens=reduce_input,
            document_input_tokens=max_model_len
            - max_tokens
            - self._overhead(self.spec.document_instruction()),
        )

    def document(self, body: Sequence[int]) -> list[int]:
        head, tail = self._frame(self.spec.document_instruction())
        return [*head, *body, *tail]

    def window(self, part: int, parts: int, body: Sequence[int]) -> list[int]:
        head, tail = self._frame(self.spec.window_instruction(part + 1, parts))
        return [*head, *body, *tail]

    def reduce(self, items: Sequence[Sequence[int]]) -> list[int]:
        head, tail = self._frame(self.spec.reduce_instruction())
        body: list[int] = []
        for position, item in enumerate(items):
            if position:
                body.extend(self.separator_ids)
            body.extend(item)
        return [*head, *body, *tail]


def plan_windows(length: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) token spans of at most `size` covering [0, length), each sharing `overlap`
    tokens with the one before."""
    if size <= overlap:
        raise ValueError(f"window size {size} must exceed the overlap {overlap}")
    spans: list[tuple[int, int]] = []
    start = 0
    while True:
        stop = min(start + size, length)
        spans.append((start, stop))
        if stop >= length:
            return spans
        start = stop - overlap


def group_items(lengths: Sequence[int], budget: int, separator: int) -> list[list[int]]:
    """Consecutive item indices packed greedily into groups whose joined length fits `budget`."""
    groups: list[list[int]] = []
    used = 0
    for index, length in enumerate(lengths):
        if groups and used + separator + length <= budget:
            groups[-1].append(index)
            used += separator + length
        else:
            groups.append([index])
            used = length
    return groups


@dataclass
class LongDocument:
    """A document summarized through windows, and the parts stored for it so far."""

    row_index: int
    token_ids: list[int]
    parts: dict[PartKey, StoredPart] = field(default_factory=dict)

    def windows(self, budget: Budget) -> list[tuple[int, int]]:
        return plan_windows(len(self.token_ids), budget.window_tokens, budget.overlap)

    def next_requests(
        self, prompts: SummaryPrompts, encode: Callable[[str], list[int]]
    ) -> list[SummaryRequest]:
        """The requests this document needs next: missing windows, then missing reduce parts of the
        lowest unfinished level, then the final reduce."""
        budget = prompts.budget
        spans = self.windows(budget)
        missing = [index for index in range(len(spans)) if (0, index) not in self.parts]
        if missing:
            return [
                SummaryRequest(
                    self.row_index,
                    RequestKind.WINDOW,
                    0,
                    index,
                    prompts.window(index, len(spans), self.token_ids[slice(*spans[index])]),
                    budget.part_max_tokens,
                )
                for index in missing
            ]
        cap = (budget.reduce_input_tokens - len(prompts.separator_ids)) // 2
        items = [encode(self.parts[(0, index)].text)[:cap] for index in range(len(spans))]
        level = 0
        while True:
            groups = group_items(
                [len(item) for item in items], budget.reduce_input_tokens, len(prompts.separator_ids)
            )
            if len(groups) == 1:
                return [
                    SummaryRequest(
                        self.row_index,
                        RequestKind.FINAL,
                        level + 1,
                        0,
                        prompts.reduce(items),
                        budget.max_tokens,
                    )
                ]
            needed: list[SummaryRequest] = []
            next_items: list[list[int]] = []
            for group_index, members in enumerate(groups):
                stored = self.parts.get((level + 1, group_index))
                if len(members) == 1:
                    next_items.append(items[members[0]])  # a lone part moves up unchanged
                elif stored is not None:
                    next_items.append(encode(stored.text)[:cap])
                else:
                    needed.append(
                        SummaryRequest(
                            self.row_index,
                            RequestKind.REDUCE,
                            level + 1,
                            group_index,
                            prompts.reduce([items[member] for member in members]),
                            budget.part_max_tokens,
                        )
                    )
            if needed:
                return needed
            items, level = next_items, level + 1

    def stored_tokens(self) -> tuple[int, int]:
        """(prompt, output) tokens of every stored part."""
        return (
            sum(part.prompt_tokens for part in self.parts.values()),
            sum(part.output_tokens for part in self.parts.values()),
        )

    def window_count(self) -> int:
        return sum(1 for level, _ in self.parts if level == 0)
