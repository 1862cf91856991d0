"""Which tokens a step emits for each sampling sequence: one sampled token, or a verified draft.

A speculating sequence's draft x_1..x_k is scored by rows 0..k (row j predicts the token after x_j, row
0 the token after the last committed one). Greedy: the longest prefix of the draft equal to each row's
argmax is kept, plus one token: the model's own at the first mismatch, or the bonus token of row k after
a fully accepted draft. The tokens are exactly those k + 1 plain decode steps would have chosen.

Sampled: the standard speculative rejection rule with a point-mass draft: accept x_j with probability
p_j(x_j) (p_j: row j's filtered distribution), else emit a token drawn from p_j with x_j removed and
renormalised, and stop. It is realised with the sampler's own exponential race (sampler.race): row j's
race winner is drawn from p_j, the draft is accepted when the winner is x_j (probability p_j(x_j)), and
on rejection the winner is, conditioned on not being x_j, distributed as p_j without x_j renormalised,
which is the rule's residual distribution. One race per emitted token, drawn from the sequence's own
generator in position order, is exactly what plain decoding draws: a seeded request emits the same
tokens alone or in any batch, with speculation on or off, whatever the step chose to draft.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from worker.engine.sampler import filtered_probs, greedy_picks, race, sample
from worker.engine.sampling_params import SamplingParams


@dataclass
class SampleGroup:
    """The logits rows one sequence samples from: 1 row, or 1 + len(draft) when it speculates."""

    params: SamplingParams
    generator: torch.Generator | None
    draft: list[int]  # [k] tokens proposed after the sequence's last token; empty without speculation


def sample_chunks(drafts: list[list[int]], max_rows: int) -> Iterator[tuple[slice, slice]]:
    """Consecutive ranges of the sampling sequences and of their logits rows (1 + len(draft) per sequence),
    each within max_rows: a sequence's rows are never split (one past max_rows is a range alone)."""
    begin, first_row, rows = 0, 0, 0
    for i, draft in enumerate(drafts):
        if rows and rows + 1 + len(draft) > max_rows:
            yield slice(begin, i), slice(first_row, first_row + rows)
            begin, first_row, rows = i, first_row + rows, 0
        rows += 1 + len(draft)
    if rows:
        yield slice(begin, len(drafts)), slice(first_row, first_row + rows)


def next_tokens(
    logits: torch.Tensor,  # [sum(1 + len(draft)), vocab] float32, the groups' rows in order, bans applied
    groups: list[SampleGroup],
    fallback: torch.Generator,
) -> list[list[int]]:
    """Tokens each group emits, in order (its accepted draft prefix plus one token)."""
    if not any(g.draft for g in groups):  # the common step: one batched choice
        return [
            [t] for t in sample(logits, [g.params for g in groups], [g.generator for g in groups], fallback)
        ]
    picks = greedy_picks(logits) if any(g.params.greedy for g in groups) else []
    out, row = [], 0
    for g in groups:
        end = row + 1 + len(g.draft)
        if g.params.greedy:
            out.append(accept_greedy(g.draft, picks[row:end]))
        else:
            out.append(verify_draft(logits[row:end], g.draft, g.params, g.generator or fallback))
        row = end
    return out


def accept_greedy_rows(drafts: list[list[int]], picks: list[int]) -> list[list[int]]:
    """accept_greedy for consecutive sequences, whose rows' picks [sum(1 + len(draft))] come in order."""
    out, row = [], 0
    for draft in drafts:
        end = row + 1 + len(draft)
        out.append(accept_greedy(draft, picks[row:end]))
        row = end
    return out


def accept_greedy(draft: list[int], picks: list[int]) -> list[int]:
    """The draft's prefix that agrees with the model's picks [1 + k], plus the model's next pick."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == picks[accepted]:
        accepted += 1
    return [*draft[:accepted], picks[accepted]]


def verify_draft(
    logits: torch.Tensor,  # [1 + k, vocab] float32
    draft: list[int],  # [k]
    params: SamplingParams,
    generator: torch.Generator,
) -> list[int]:
    """The accepted prefix of `draft` plus one token (see the module docstring)."""
    if params.greedy:
        return accept_greedy(draft, greedy_picks(logits))
    emitted = []
    for j in range(len(draft) + 1):
        # the race winner is draft[j] with probability p_j(draft[j]); any other winner is the residual draw
        token = race(filtered_probs(logits[j], params), generator)
        emitted.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return emitted
