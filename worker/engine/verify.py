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

from dataclasses import dataclass

import torch

from worker.engine.sampler import filtered_probs, race, sample
from worker.engine.sampling_params import SamplingParams


@dataclass
class SampleGroup:
    """The logits rows one sequence samples from: 1 row, or 1 + len(draft) when it speculates."""

    params: SamplingParams
    generator: torch.Generator | None
    draft: list[int]  # [k] tokens proposed after the sequence's last token; empty without speculation


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
    out, row = [], 0
    for g in groups:
        rows = logits[row : row + 1 + len(g.draft)]
        out.append(verify_draft(rows, g.draft, g.params, g.generator or fallback))
        row += 1 + len(g.draft)
    return out


def verify_draft(
    logits: torch.Tensor,  # [1 + k, vocab] float32
    draft: list[int],  # [k]
    params: SamplingParams,
    generator: torch.Generator,
) -> list[int]:
    """The accepted prefix of `draft` plus one token (see the module docstring)."""
    if params.greedy:
        picks = logits.argmax(dim=-1).tolist()  # [1 + k]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == picks[accepted]:
            accepted += 1
        return [*draft[:accepted], picks[accepted]]
    emitted = []
    for j in range(len(draft) + 1):
        # the race winner is draft[j] with probability p_j(draft[j]); any other winner is the residual draw
        token = race(filtered_probs(logits[j], params), generator)
        emitted.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return emitted
