"""Prompt-lookup speculative decoding: drafts read from a sequence's own tokens, verified in one step.

What: for each decoding sequence, the longest suffix n-gram of its tokens (MAX_NGRAM down to MIN_NGRAM
tokens) that also occurs earlier in its prompt or output proposes the tokens that followed its most recent
earlier occurrence. The step feeds the last token and k draft tokens as 1 + k decode rows (each attends up
to its own position, exactly as k + 1 plain decodes would); verify.py keeps the longest agreeing run plus
one token, and the KV slots of rejected tokens are trimmed. Why: a summary copies names, numbers and
phrases from its document, so such a lookup costs microseconds and needs no second model.

How many tokens: k starts at num_speculative_tokens, grows by 2 after a fully accepted draft and shrinks by
1 after a rejection. An exponential average of the accepted share is the sequence's expected acceptance;
below ACCEPTANCE_FLOOR its drafts are not fed but kept as shadows, scored against the tokens it emits next
at no cost, so a sequence that starts copying (or falls into a loop) drafts again at once.

When: speculation saves whole steps, so it pays only where extra rows are cheap. A step over a few
sequences is bound by reading the weights once; a step of many rows by arithmetic, where k draft rows cost
about k decodes. With a small-batch measurement (INT8 on CPU) the step prices rows with it (step_cost.py)
and takes each draft, best acceptance first, only while its expected accepted rows raise the step's useful
rows per second by PAY_MARGIN. In the tail (nothing waiting or prefilling) the batch runs until its slowest
sequence ends, so each token that sequence gains saves about a one-row step; not knowing which one it is,
the sequences that started decoding last (within TAIL_SLACK steps) share that saving. Without a measurement
(float compute, CUDA) a step drafts while its rows stay within DEFAULT_MAX_ROWS (or an integer
`speculation_max_rows`). The rule in prose: docs/engine.md; measurements: docs/benchmarks.md.

Draft slots always lie past a sequence's committed tokens, in blocks it allocated itself (never shared:
cached blocks are full blocks of committed tokens), and drafts take only blocks on the free list, so they
never evict a cached block.
"""

from __future__ import annotations

from array import array

from worker.engine.block_manager import BlockManager
from worker.engine.draft_state import ACCEPTANCE_PRIOR, TOKEN_BYTES, DraftState
from worker.engine.scheduler import SchedulerOutput
from worker.engine.sequence import Sequence
from worker.engine.step_cost import StepCost
from worker.engine.verify import accept_greedy

PAY_MARGIN = 1.25  # a draft's marginal useful rows per second must beat the step's average by this
MAX_NGRAM = 4  # longest suffix looked up; longer matches are rarer and 4 tokens already pin a phrase
# shortest suffix looked up: on 16 long-document summaries (bfloat16 + W8A8) 1- and 2-token matches
# proposed drafts the model took 4.9% and 4.2% of, which kept every sequence under the floor; from 3 tokens, 52-56%
MIN_NGRAM = 3
TAIL_SLACK = 8  # steps: a sequence that started decoding this close to the last one may still end the batch
DEFAULT_MAX_ROWS = 16  # row bound where nothing was measured (float compute, CUDA)
ACCEPTANCE_FLOOR = 0.3  # below this average accepted share a sequence only shadows its drafts


def lookup(
    history: bytes | bytearray, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram.

    history: the sequence's tokens as int32 (array("i") bytes). bytes.rfind does the search in C; a hit
    not aligned to a token boundary is skipped by searching again before it.
    """
    num_tokens = len(history) // TOKEN_BYTES
    for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        pattern = bytes(history[-n * TOKEN_BYTES :])
        # an earlier occurrence must end by the last token, so that at least one token follows it
        end = (num_tokens - 1) * TOKEN_BYTES
        while (hit := history.rfind(pattern, 0, end)) >= 0:
            if hit % TOKEN_BYTES == 0:
                first = hit // TOKEN_BYTES + n
                last = min(first + k, num_tokens)
                return array("i", history[first * TOKEN_BYTES : last * TOKEN_BYTES]).tolist()
            end = hit + len(pattern) - 1
    return []


def propose(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """lookup() over a plain token list."""
    return lookup(array("i", tokens).tobytes(), k, max_ngram, min_ngram)


def lookup_steps(prompt: list[int], output: list[int], k: int) -> int:
    """The steps greedy decoding of `output` after `prompt` takes when every step feeds its lookup draft (up
    to k tokens) and keeps what greedy verification keeps: the fewest that prompt lookup can take a sequence
    in (the engine's rule feeds fewer drafts, where they do not pay). scripts/spec_bench.py replays a run's
    outputs with it to find what speculation could give that work at best."""
    history = bytearray(array("i", prompt).tobytes())  # [num_tokens] int32, as DraftState keeps it
    steps = done = 0
    while done < len(output):
        picks = output[done : done + k + 1]  # the model's greedy picks are the output itself
        emitted = accept_greedy(lookup(history, k)[: len(picks) - 1], picks)
        history += array("i", emitted).tobytes()
        done += len(emitted)
        steps += 1
    return steps


class Speculator:
    """Chooses the drafts of a step (where they pay) and settles them once the model has scored them."""

    def __init__(
        self,
        blocks: BlockManager,
        num_speculative_tokens: int,
        max_model_len: int,
        *,
        step_cost: StepCost | None = None,
        max_rows: int | None = None,
    ) -> None:
        """step_cost prices rows (the "auto" rule); max_rows bounds the rows of a drafting step (None:
        only max_num_batched_tokens)."""
        self.blocks = blocks
        self.max_k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.step_cost = step_cost
        self.max_rows = max_rows
        self.min_ngram = MIN_NGRAM
        self._steps = 0  # steps proposed for so far: when each sequence started decoding

    def propose(self, out: SchedulerOutput, max_num_batched_tokens: int, *, num_waiting: int = 0) -> None:
        """Give the step's decodes their drafts (out.drafts) where they pay, and allocate the draft slots;
        drafts that are not fed become shadows. num_waiting: requests not yet admitted (none: the tail)."""
        cap = max_num_batched_tokens if self.max_rows is None else min(self.max_rows, max_num_batched_tokens)
        rows = out.num_tokens
        useful = float(rows)  # every prefill token and decode row is work the job needs
        self._steps += 1
        tail_shares = self._tail_values(out, num_waiting)
        if rows >= cap or not self._pays(rows, useful, 1, 1.0, max(tail_shares.values(), default=0.0)):
            return  # not even a sure one-token draft would pay (a full batch): no lookups at all
        for seq in sorted(out.decodes, key=self._priority):
            state = self._state(seq)
            state.sync(seq)
            k = min(state.k, self._room(seq))
            if state.shadow or k <= 0:
                continue  # one prediction at a time: a shadow is scored before the next lookup
            draft = lookup(state.history, k, min_ngram=self.min_ngram)
            if not draft:
                continue
            fits = draft[: cap - rows]
            if (
                fits
                and state.acceptance >= ACCEPTANCE_FLOOR
                and self._pays(rows, useful, len(fits), state.acceptance, tail_shares.get(seq, 0.0))
            ):
                self.blocks.allocate(seq, seq.num_tokens + len(fits))
                out.drafts[seq] = fits
                rows += len(fits)
                useful += state.acceptance * len(fits)
            else:
                state.keep_shadow(draft, seq.num_tokens)

    def _tail_values(self, out: SchedulerOutput, num_waiting: int) -> dict[Sequence, float]:
        """What an accepted token is worth beyond the row it frees, in step-cost seconds, per sequence: in
        the tail (nothing waiting, nothing prefilling) the batch lasts as long as its slowest sequence, and
        each token that sequence gains removes one of the last steps, which cost about a one-row step. Which
        one is slowest is not known (any may stop at its next token, and one that copies, so drafts well,
        is often one that loops to max_tokens), so the share goes evenly to those that started decoding
        last (within TAIL_SLACK steps): a sequence that started earlier has that many steps' start on them."""
        if self.step_cost is None or num_waiting or out.prefills or not out.decodes:
            return {}
        started = {seq: self._state(seq).first_step for seq in out.decodes}
        latest = max(started.values())
        last = [seq for seq, step in started.items() if step >= latest - TAIL_SLACK]
        return dict.fromkeys(last, self.step_cost(1) / len(last))

    def _pays(self, rows: int, useful: float, k: int, acceptance: float, tail_share: float = 0.0) -> bool:
        """Whether k more draft rows are worth PAY_MARGIN times their cost: each accepted token saves an
        average row of this step, plus its share of the tail's steps (module docstring)."""
        if self.step_cost is None:
            return True
        now, after = self.step_cost(rows), self.step_cost(rows + k)
        return acceptance * k * (now / useful + tail_share) >= PAY_MARGIN * (after - now)

    def _priority(self, seq: Sequence) -> tuple[float, int]:
        state = seq.draft_state
        return (-(state.acceptance if state else ACCEPTANCE_PRIOR), seq.request_id)

    def _state(self, seq: Sequence) -> DraftState:
        if seq.draft_state is None:
            seq.draft_state = DraftState(k=self.max_k, max_k=self.max_k, first_step=self._steps)
        return seq.draft_state

    def _room(self, seq: Sequence) -> int:
        """Most draft tokens worth feeding: the emitted tokens (draft + 1) must fit max_tokens and
        max_model_len, and the draft slots blocks from the free list (taking a cached block would evict it)."""
        fits_output = seq.params.max_tokens - len(seq.output_token_ids) - 1
        fits_model = self.max_model_len - seq.num_tokens
        bs = self.blocks.block_size
        fits_blocks = (len(seq.block_table) + self.blocks.num_fresh) * bs - seq.num_tokens
        return min(fits_output, fits_model, fits_blocks)

    def settle(self, seq: Sequence, start: int, proposed: int, accepted: int) -> int:
        """After the step: `seq` fed positions [start, start + 1 + proposed) and the model agreed with
        `accepted` draft tokens. Slots past the tokens it kept count as uncomputed; blocks past its tokens
        go back; newly full blocks of committed tokens are registered. Returns the tokens computed."""
        # K/V are valid for the fed last token and the accepted drafts, as far as the sequence kept them
        # (a finish inside the draft drops the rest)
        seq.num_computed_tokens = min(start + 1 + accepted, seq.num_tokens)
        self.blocks.trim(seq, seq.num_tokens)
        self.blocks.register_full(seq, start, seq.num_computed_tokens)
        if seq.draft_state is not None:
            seq.draft_state.observe(proposed, accepted)
        return seq.num_computed_tokens - start
