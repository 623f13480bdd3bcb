"""Decides after each new token whether a sequence is finished, and cuts stop strings."""

from __future__ import annotations

from octavo.engine.sampling_params import SamplingParams
from octavo.engine.sequence import Sequence, SequenceStatus


class StopChecker:
    """Applies vLLM's stop rules, in order, to a sequence that just received a token.

    Before `min_tokens` outputs only the length limits apply (the sampler already keeps EOS and
    stop_token_ids from being drawn). Then: EOS (unless ignore_eos), stop_token_ids, stop
    strings (searched in the newly decoded text plus enough of the old text to catch a string
    split across tokens; the text is cut before the string unless include_stop_str_in_output),
    max_tokens, max_model_len.
    """

    def __init__(self, max_model_len: int, eos_token_id: int | None):
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def check(self, seq: Sequence, params: SamplingParams, new_text: str) -> None:
        token_id = seq.token_ids[-1]
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == self.eos_token_id:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                if new_text and not params.include_stop_str_in_output:
                    seq.detokenizer.text = seq.detokenizer.text[: -len(new_text)]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token_id
                return
            if params.stop_strings and new_text and self._check_stop_strings(seq, params, new_text):
                return
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    @staticmethod
    def _check_stop_strings(seq: Sequence, params: SamplingParams, new_text: str) -> bool:
        text = seq.detokenizer.text
        best: tuple[int, str] | None = None
        for stop in params.stop_strings:
            # A match must end inside the new text, so it starts at most len(stop) - 1 before it.
            start = max(len(text) - len(new_text) - len(stop) + 1, 0)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        cut = index + len(stop) if params.include_stop_str_in_output else index
        seq.detokenizer.text = text[:cut]
        seq.status = SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = stop
        return True
