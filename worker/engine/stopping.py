"""When a sequence is done: EOS, stop token ids, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from worker.engine.outputs import FinishReason
from worker.engine.sequence import Sequence


class FinishChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_model_len = max_model_len

    def banned_tokens(self, seq: Sequence, num_output: int | None = None) -> list[int]:
        """Tokens that would end the sequence before min_tokens, masked out of the logits that choose its
        output token number `num_output` (by default the next one; a draft's rows choose later ones)."""
        if (len(seq.output_token_ids) if num_output is None else num_output) >= seq.params.min_tokens:
            return []
        eos = [] if seq.params.ignore_eos else self.eos_token_ids
        return [*eos, *seq.params.stop_token_ids]

    def decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def check(self, seq: Sequence) -> FinishReason | None:
        """Called after each new token of `seq`."""
        params = seq.params
        token = seq.output_token_ids[-1]
        n = len(seq.output_token_ids)
        if n >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
            if params.stop and self._match_stop_string(seq):
                return "stop"
        if n >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _match_stop_string(self, seq: Sequence) -> bool:
        text = self.decode(seq)
        # only the tail can hold a new match: the last token adds a few characters at most
        window = max(len(s) for s in seq.params.stop) + 32
        start = max(0, len(text) - window)
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.stop_text_end = min(hits)
        return True

    def final_text(self, seq: Sequence) -> str:
        text = self.decode(seq)
        return text[: seq.stop_text_end] if seq.stop_text_end is not None else text
