"""Map-reduce planning for long documents, with a character-level stand-in tokenizer so every length
is known exactly: windows cover the document with the overlap, reduce levels shrink until one request
holds everything, every prompt fits the context, and stored parts are never asked for again."""

from __future__ import annotations

import pytest

from jobs.domain.summarize_spec import SummarizeSpec
from storage.summary_store import StoredPart
from worker.map_reduce import (
    LongDocument,
    RequestKind,
    SummaryPrompts,
    frame_pieces,
    group_items,
    plan_windows,
)

pytestmark = pytest.mark.unit  # the unit lane (scripts/test.sh --unit)


def encode(text: str) -> list[int]:
    return [ord(char) for char in text]


def render_chat(content: str) -> str:
    return f"<user>{content}</user><assistant>"


def spec(**overrides) -> SummarizeSpec:
    values = dict(
        column="text", style="one paragraph", template=None, long_documents="map_reduce", id_column=None
    )
    return SummarizeSpec(**{**values, **overrides})


@pytest.mark.parametrize(
    ("length", "size", "overlap"), [(1, 10, 2), (10, 10, 2), (11, 10, 2), (1000, 97, 13)]
)
def test_windows_cover_the_document_with_the_overlap(length: int, size: int, overlap: int) -> None:
    spans = plan_windows(length, size, overlap)
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(0 < stop - start <= size for start, stop in spans)
    for (_, previous_stop), (start, _) in zip(spans, spans[1:], strict=False):
        assert previous_stop - start == overlap
    with pytest.raises(ValueError):
        plan_windows(10, 4, 4)


def test_groups_are_consecutive_and_fit_the_budget() -> None:
    lengths = [5, 5, 5, 9, 1, 1, 10]
    groups = group_items(lengths, budget=12, separator=1)
    assert [index for group in groups for index in group] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in group) + len(group) - 1 <= 12 for group in groups)
    assert groups == [[0, 1], [2], [3, 4], [5, 6]]


def test_a_template_is_split_around_its_text_placeholder() -> None:
    assert frame_pieces("Sum {{up}}: {text} now") == ("Sum {up}: ", " now")


def run_to_completion(document: LongDocument, prompts: SummaryPrompts, summary_chars: int) -> list[list]:
    """Plays the engine: answers each round's requests with a fixed-length text and stores it."""
    rounds = []
    while True:
        requests = document.next_requests(prompts, encode)
        rounds.append(requests)
        assert all(len(r.prompt_ids) + r.max_tokens <= prompts.budget.max_model_len for r in requests)
        if requests[0].kind == RequestKind.FINAL:
            assert len(requests) == 1
            return rounds
        for request in requests:
            text = f"<{request.level}.{request.part_index}>".ljust(
                min(summary_chars, request.max_tokens), "s"
            )
            document.parts[(request.level, request.part_index)] = StoredPart(
                text, len(request.prompt_ids), len(text)
            )
        assert len(rounds) < 20


def test_a_long_document_goes_through_windows_then_reduce_levels_to_one_final_request() -> None:
    prompts = SummaryPrompts(encode, render_chat, spec(), max_model_len=600, max_tokens=120)
    budget = prompts.budget
    document = LongDocument(7, encode("word " * 2000))  # 10,000 tokens
    rounds = run_to_completion(document, prompts, summary_chars=200)
    windows = rounds[0]
    assert all(r.kind == RequestKind.WINDOW and r.level == 0 for r in windows)
    assert len(windows) == len(plan_windows(10_000, budget.window_tokens, budget.overlap)) > 20
    levels = [{r.level for r in requests} for requests in rounds[1:-1]]
    assert levels == [{level} for level in range(1, len(levels) + 1)] and len(levels) >= 2
    # Each level at least halves the number of parts.
    counts = [len(windows)] + [len(requests) for requests in rounds[1:-1]]
    assert all(later <= -(-earlier // 2) for earlier, later in zip(counts, counts[1:], strict=False))
    final = rounds[-1][0]
    assert final.max_tokens == 120 and final.row_index == 7
    # Partial summaries are short enough that two always fit one reduce request.
    assert 2 * budget.part_max_tokens + 2 <= budget.reduce_input_tokens


def test_stored_parts_are_not_asked_for_again() -> None:
    prompts = SummaryPrompts(encode, render_chat, spec(), max_model_len=600, max_tokens=120)
    fresh = LongDocument(1, encode("text " * 900))
    first_round = fresh.next_requests(prompts, encode)
    resumed = LongDocument(1, fresh.token_ids)
    resumed.parts = {(0, 0): StoredPart("done", 1, 1), (0, 2): StoredPart("done", 1, 1)}
    again = resumed.next_requests(prompts, encode)
    assert [r.part_index for r in again] == [r.part_index for r in first_round if r.part_index not in (0, 2)]
    # With every part stored, the same plan (and so the same final prompt) comes back.
    done_a, done_b = LongDocument(1, fresh.token_ids), LongDocument(1, fresh.token_ids)
    run_to_completion(done_a, prompts, summary_chars=100)
    done_b.parts = dict(done_a.parts)
    assert done_b.next_requests(prompts, encode) == done_a.next_requests(prompts, encode)


def test_prompts_hold_the_instruction_and_the_body_in_the_chat_template() -> None:
    prompts = SummaryPrompts(
        encode, render_chat, spec(style="two sentences"), max_model_len=400, max_tokens=50
    )
    text = "".join(map(chr, prompts.document(encode("BODY"))))
    assert text.startswith("<user>Summarize the following document. Write the summary as two sentences.")
    assert text.endswith("BODY</user><assistant>")
    window = "".join(map(chr, prompts.window(2, 5, encode("PART"))))
    assert "part 3 of 5" in window and "PART</user>" in window
    reduce = "".join(map(chr, prompts.reduce([encode("one"), encode("two")])))
    assert "one\n\ntwo</user>" in reduce and "Combine them" in reduce
    custom = SummaryPrompts(
        encode, render_chat, spec(template="TL;DR {text}"), max_model_len=400, max_tokens=50
    )
    assert "".join(map(chr, custom.window(0, 2, encode("X")))) == "<user>TL;DR X</user><assistant>"


def test_no_room_for_map_reduce_is_an_error() -> None:
    with pytest.raises(ValueError, match="no room"):
        SummaryPrompts(encode, render_chat, spec(), max_model_len=200, max_tokens=190)
