"""Structured output: each constrained request's tokens are masked to those its grammar allows.

xgrammar compiles a request's constraint (a JSON schema, any JSON object, a regex, a list of choices)
against the tokenizer once per engine (`StructuredDecoder.compile`, cached by the constraint, refusals
included), keeps one matcher per sequence, and fills a bitmask over the model's vocabulary on the CPU for
the constrained rows of a step only; one `apply_token_bitmask_inplace` call masks them all. A step
without a constrained row does no mask work at all. Each emitted token advances its sequence's matcher;
when the matcher terminates (the grammar is complete and its stop token was emitted) the sequence stops.

JSON is generated compactly (no free whitespace: `any_whitespace=False`), which keeps outputs short
and leaves a weak model no room to ramble in blanks. Compact JSON never holds a raw control character
(inside strings they must be escaped), yet xgrammar 0.2's grammar for a string with `maxLength` lets
them through (a raw 0x1F made an output invalid JSON), so JSON rows also mask every token with a byte
below 0x20. A constraint xgrammar refuses (an unsupported
schema keyword, a lookbehind in a regex, a schema that is not JSON) fails only its request, with the
grammar engine's reason.

A constrained sequence speculates like any other (an extraction copies names and numbers from its
document): its draft rows are masked along the draft (the matcher walks the draft, fills each row's
mask, and rolls back), so the tokens are those plain decoding would choose; a draft token the grammar
refuses ends verification there.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

    from worker.engine.sequence import Sequence

CACHE_ENTRIES = 512  # distinct constraints kept compiled per engine (least recently used dropped)
MAX_CHOICES = 1024


@dataclass
class Compiled:
    grammar: xgrammar.CompiledGrammar | None
    error: str | None  # why the grammar engine refused the constraint


def choice_grammar(options: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of `options` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)


def grammar_for(spec: StructuredOutput) -> xgrammar.Grammar:
    """The constraint as an xgrammar Grammar (no tokenizer needed); raises with the grammar engine's reason
    when it refuses it. The one definition of each kind's grammar: engines compile it against their
    tokenizer, and the API's submission check (grammar_check.py) only builds it."""
    import xgrammar as xgr

    if spec.kind == "json_schema":
        # strict: no properties or items beyond those the schema names (OpenAI's strict mode)
        return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if len(spec.value) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} options, got {len(spec.value)}")
    return xgr.Grammar.from_ebnf(choice_grammar(spec.value))


def refusal_message(spec: StructuredOutput, exc: Exception) -> str:
    return f"{spec.kind} refused by the grammar engine: {_reason(exc)}"


class StructuredDecoder:
    """Per engine: the tokenizer's xgrammar view, the compile cache, one matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width), which may exceed the tokenizer's
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on the first constrained request
        self._cache: OrderedDict[StructuredOutput, Compiled] = OrderedDict()
        self._matchers: weakref.WeakKeyDictionary[Sequence, xgrammar.GrammarMatcher] = (
            weakref.WeakKeyDictionary()
        )
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, grown on demand
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        # [ceil(vocab / 32)] int32 bitmask words: every token but those with a byte below 0x20
        self._json_words: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (refusals included): a cache miss each

    # -- compile ---------------------------------------------------------------------------------------

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            special = set(self._stop_token_ids) | set(getattr(self._tokenizer, "all_special_ids", []))
            with torch.inference_mode(False):  # a plain tensor, usable in and out of inference mode
                words = xgr.allocate_token_bitmask(1, self.vocab_size)[0]  # all bits set: every token allowed
            for token, raw in enumerate(info.decoded_vocab):
                if token not in special and any(b < 0x20 for b in raw):
                    words[token // 32] &= ~(1 << (token % 32))
            self._json_words = words
            # our own cache below (keyed by the constraint, refusals too) replaces xgrammar's
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=max(1, torch.get_num_threads()), cache_enabled=False
            )
        return self._compiler

    def compile(self, spec: StructuredOutput) -> Compiled:
        """The compiled grammar of `spec` (once per engine), or why the grammar engine refused it."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self.compiles += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Compiled:
        try:
            compiler = self._get_compiler()
            return Compiled(compiler.compile_grammar(grammar_for(spec)), None)
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) with its reason
            return Compiled(None, refusal_message(spec, exc))

    # -- per sequence ----------------------------------------------------------------------------------

    def attach(self, seq: Sequence) -> str | None:
        """Give a constrained sequence its matcher; None, or the error that fails the request."""
        import xgrammar as xgr

        compiled = self.compile(seq.params.structured)
        if compiled.error is not None:
            return f"structured output: {compiled.error}"
        matcher = xgr.GrammarMatcher(compiled.grammar)
        for token in seq.output_token_ids:  # a sequence re-added with output (never today) resumes
            matcher.accept_token(token)
        self._matchers[seq] = matcher
        return None

    def advance(self, seq: Sequence, token: int) -> tuple[str | None, str | None]:
        """Feed the sequence's newest token to its matcher: (finish reason or None, error or None)."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return "error", "structured output: the sequence has no grammar matcher"
        if not matcher.accept_token(token):
            self._matchers.pop(seq, None)
            return "error", f"structured output: token {token} is not allowed by the grammar"
        if matcher.is_terminated():
            self._matchers.pop(seq, None)
            return "stop", None
        return None, None

    # -- the step's masks ------------------------------------------------------------------------------

    def apply_masks(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> None:
        """Mask the logits rows of the constrained sequences to their grammar (in place, one call).

        logits: [sum(1 + len(draft)), model vocab], the sequences' rows in order."""
        import xgrammar as xgr

        plain: list[xgrammar.GrammarMatcher] = []
        plain_rows: list[int] = []
        walks: list[tuple[xgrammar.GrammarMatcher, int, list[int], bool]] = []
        json_rows: list[int] = []  # filled rows of JSON constraints
        row = 0
        for seq, draft in zip(seqs, drafts, strict=True):
            matcher = self._matchers.get(seq) if seq.params.structured is not None else None
            if matcher is not None:
                is_json = seq.params.structured.kind in ("json_schema", "json_object")
                if draft:
                    walks.append((matcher, row, draft, is_json))
                else:
                    plain.append(matcher)
                    plain_rows.append(row)
                    if is_json:
                        json_rows.append(row)
            row += 1 + len(draft)
        if not plain and not walks:
            return
        bitmask = self._bitmask_rows(logits.shape[0])
        rows = list(plain_rows)
        if plain:
            if len(plain) == 1:
                plain[0].fill_next_token_bitmask(bitmask, plain_rows[0])
            else:
                if self._batch is None:
                    self._batch = xgr.BatchGrammarMatcher(max(1, torch.get_num_threads()))
                self._batch.batch_fill_next_token_bitmask(plain, bitmask, plain_rows)
        for matcher, first, draft, is_json in walks:
            filled = _fill_along_draft(matcher, bitmask, first, draft)
            rows.extend(filled)
            if is_json:
                json_rows.extend(filled)
        if json_rows:  # no raw control characters in JSON (module docstring)
            bitmask[json_rows] &= self._json_words
        mask = bitmask[: logits.shape[0]]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=sorted(rows))

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            with torch.inference_mode(False):  # updated in place by steps and by direct callers alike
                self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask


def _fill_along_draft(matcher, bitmask: torch.Tensor, first: int, draft: list[int]) -> list[int]:
    """Fill the masks of a speculating sequence's rows: row j's after the draft's first j tokens, as far as
    the grammar accepts the draft (later rows go unused: verification stops at the refused token). The
    matcher is rolled back to where it was; the emitted tokens advance it afterwards."""
    matcher.fill_next_token_bitmask(bitmask, first)
    filled, accepted = [first], 0
    for j, token in enumerate(draft):
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, first + 1 + j)
        filled.append(first + 1 + j)
    if accepted:
        matcher.rollback(accepted)
    return filled


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        parts = rest.split(": ", 1)
        if len(parts) == 2 and ".cc:" in parts[0]:
            text = parts[1]
    return text.splitlines()[0][:500] if text else type(exc).__name__
