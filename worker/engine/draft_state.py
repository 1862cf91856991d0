"""One sequence's prompt-lookup drafting state (speculation.py decides with it; the sequence holds it).

It lives apart from speculation.py so that sequence.py can hold one without importing the speculator,
and it reads the sequence only through `TokenSource`, so it imports nothing of the engine.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Protocol

ACCEPTANCE_PRIOR = 0.6  # a new sequence's expected accepted share, until its drafts are verified
ACCEPTANCE_WEIGHT = 0.25  # weight of the newest verification (or shadow score) in the average
TOKEN_BYTES = array("i").itemsize  # token ids are stored as native int32 in the search buffer


class TokenSource(Protocol):
    """What a draft state reads of its sequence: its length and a range of its tokens."""

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


@dataclass
class DraftState:
    """One sequence's drafting: its tokens as a search buffer, what its acceptance earned it, and the draft
    it did not feed (its shadow), waiting to be scored against the tokens that come."""

    k: int  # draft length to propose next
    max_k: int
    acceptance: float = ACCEPTANCE_PRIOR  # average accepted share of proposed tokens
    history: bytearray = field(default_factory=bytearray)  # [num_tokens] int32
    shadow: list[int] = field(default_factory=list)  # predicted tokens from position shadow_at on
    shadow_at: int = 0
    first_step: int = 0  # the speculator's step count when the sequence first decoded

    def sync(self, seq: TokenSource) -> None:
        """Append the tokens the sequence gained since the last lookup (tokens never change), and score
        the shadow draft as far as they reach."""
        have = len(self.history) // TOKEN_BYTES
        if have < seq.num_tokens:
            self.history += array("i", seq.tokens(have, seq.num_tokens)).tobytes()
            if self.shadow:
                self._score_shadow(seq.num_tokens)

    def keep_shadow(self, draft: list[int], at: int) -> None:
        self.shadow, self.shadow_at = draft, at

    def _score_shadow(self, num_tokens: int) -> None:
        """Observe the shadow once its first disagreement, or its whole length, is known: the longest
        agreeing run is what greedy verification would have accepted (and, for a sampled sequence, the
        expected acceptance of the rejection rule, p(draft token) per token)."""
        known = min(len(self.shadow), num_tokens - self.shadow_at)
        came = array("i", self.history[self.shadow_at * TOKEN_BYTES : (self.shadow_at + known) * TOKEN_BYTES])
        agreed = next(
            (j for j, (a, b) in enumerate(zip(came, self.shadow[:known], strict=True)) if a != b), known
        )
        if agreed < known or known == len(self.shadow):
            self.observe(len(self.shadow), agreed)
            self.shadow = []

    def observe(self, proposed: int, accepted: int) -> None:
        """Adapt k and the expected acceptance to one verification (or shadow score) of `proposed` tokens."""
        w = ACCEPTANCE_WEIGHT
        self.acceptance = (1 - w) * self.acceptance + w * accepted / proposed
        self.k = min(self.max_k, self.k + 2) if accepted == proposed else max(1, self.k - 1)
