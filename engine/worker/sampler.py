"""Token sampling for a batch of sequences, each with its own SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from octavo.engine.sampling_params import MIN_SAMPLING_TEMPERATURE
from octavo.engine.step_io import SamplerOutput
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.engine.worker.sampling_batch import NO_LOGPROBS, SamplingBatch
from octavo.engine.worker.sampling_state import SamplingState
from octavo.engine.worker.step_inputs import on_device

# The largest logit a bias or a penalty may leave. Divided by the least sampling temperature
# it stays finite in float32; an inf there would meet another in the softmax as inf - inf,
# NaN, which the draw picks. Half the limit leaves room for the model's own logit beside a
# bias at this bound. Either is as decisive as any larger value.
MAX_TEMPERABLE_LOGIT = float(torch.finfo(torch.float32).max) * MIN_SAMPLING_TEMPERATURE / 2


@dataclass
class SampledTokens:
    """A batch's sampled tokens where the sampler computed them (the device), one row per
    request: token_ids int64 [R]; when some row asked for logprobs, every row's model
    log-probability float32 [R], best tokens (top_values / top_ids [R, K], K the most any
    row asked for) and `num_top`, per row the number asked for (None: not asked)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    num_top: list[int | None] | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        tensors = (self.token_ids, self.logprobs, self.top_values, self.top_ids)
        return [t for t in tensors if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> SampledTokens:
        """The same results over other copies of `tensors` (host copies, in order)."""
        if len(tensors) == 1:
            return SampledTokens(tensors[0])
        token_ids, logprobs, top_values, top_ids = tensors
        return SampledTokens(token_ids, logprobs, top_values, top_ids, self.num_top)

    def to_host(self) -> SamplerOutput:
        """Lists and per-row {token_id: logprob} maps (the sampled token first), None for
        rows that did not ask for logprobs; a sync point on a device."""
        token_ids = self.token_ids.tolist()
        top: list[dict[int, float] | None] = [None] * len(token_ids)
        if self.logprobs is None or self.num_top is None:
            return SamplerOutput(token_ids, [None] * len(token_ids), top)
        row_logprobs: list[float] = self.logprobs.tolist()
        assert self.top_values is not None and self.top_ids is not None
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        logprobs: list[float | None] = [None] * len(token_ids)
        for i, n in enumerate(self.num_top):
            if n is not None:
                logprobs[i] = row_logprobs[i]
                top[i] = logprob_entry(token_ids[i], row_logprobs[i], ids[i][:n], values[i][:n])
        return SamplerOutput(token_ids, logprobs, top)


def logprob_entry(
    token_id: int, logprob: float, top_ids: list[int], top_values: list[float]
) -> dict[int, float]:
    """{token_id: logprob}, then each of the best tokens not already there, best first."""
    entry = {token_id: logprob}
    for top_id, value in zip(top_ids, top_values, strict=True):
        entry.setdefault(top_id, value)
    return entry


class Sampler:
    """Turns logits into tokens following vLLM's order of operations.

    allowed_token_ids -> bad_words and min_tokens (EOS, stop_token_ids) masks -> logit_bias ->
    penalties (repetition on prompt + output, presence/frequency on output) -> the
    structured-output grammar's mask -> greedy argmax,
    or temperature -> min_p -> top_k -> top_p -> a draw. A draw is argmax(probs / Exp(1)
    noise), an exact sample from `probs`; a seeded request draws its noise from its own
    generator, so the tokens it gets do not depend on the other rows. Reported
    log-probabilities are those of the model (log_softmax of the raw logits), as vLLM reports
    them, and only for rows whose request asked for logprobs.
    """

    def __init__(self, generator: torch.Generator, grammars: GrammarMatchers):
        self.generator = generator
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """logits: [num_rows, vocab] in the model's dtype, one row per row of `batch`. Nothing
        here waits for the device: the results stay where they were computed until
        `SampledTokens.to_host`."""
        if batch.all_plain_greedy:
            # The fast path: one pass over the logits as they are (widening to float32 is
            # exact and keeps their order, so the argmax is the same).
            return SampledTokens(argmax_rows(logits))
        logits = logits.float()
        num_top = batch.num_top
        logprobs = torch.log_softmax(logits, dim=-1) if (num_top != NO_LOGPROBS).any() else None
        logits = self._process(logits, batch)
        sampled = argmax_rows(logits)
        random_rows = np.flatnonzero(~batch.greedy)
        if len(random_rows):
            rows = on_device(random_rows, logits.device)
            sampled[rows] = self._sample_random(logits[rows], batch, random_rows)
        penalized = batch.penalized_rows
        if len(penalized):
            rows = on_device(penalized, sampled.device)
            batch.penalties.count(batch.slots[penalized], sampled[rows])
        if logprobs is None:
            return SampledTokens(sampled)
        out = SampledTokens(sampled, logprobs.gather(1, sampled[:, None]).squeeze(1))
        out.top_values, out.top_ids = logprobs.topk(max(int(num_top.max()), 0), dim=-1)
        out.num_top = [None if n == NO_LOGPROBS else n for n in num_top.tolist()]
        return out

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Applies each row's own logits processing (`_process_row`), then the penalties of
        the penalized rows, then the grammar masks of the constrained rows, last as in vLLM;
        copies `logits` only when some row has any."""
        processed, penalized = batch.processed_rows, batch.penalized_rows
        constrained = batch.constrained_rows
        if not len(processed) and not len(penalized) and not len(constrained):
            return logits
        logits = logits.clone()
        for i in processed.tolist():
            logits[i] = self._process_row(logits[i], batch.states[i], int(batch.num_sampled[i]))
        if len(penalized):
            batch.penalties.apply(logits, batch)
        if len(constrained):
            matchers = [batch.states[i].matcher for i in constrained.tolist()]
            self.grammars.apply_masks(logits, constrained, matchers)  # type: ignore[arg-type]
        return logits

    def _process_row(
        self, row: torch.Tensor, request: SamplingState, num_sampled: int
    ) -> torch.Tensor:
        """vLLM's order: allowed_token_ids, then bad_words and min_tokens masks, then
        logit_bias (the penalties come after, for all penalized rows at once)."""
        params = request.params
        if params.allowed_token_ids is not None:
            kept = on_device(params.allowed_token_ids, row.device)
            only = torch.full_like(row, float("-inf"))
            only[kept] = 0.0
            row = row + only
        banned = self._bad_words_mask(request)
        if num_sampled - 1 < params.min_tokens:  # outputs before this one (it is counted)
            banned += request.stop_token_ids
        if banned:
            row[banned] = float("-inf")
        if params.logit_bias:
            tokens = on_device(list(params.logit_bias), row.device)
            bias = on_device(list(params.logit_bias.values()), row.device, row.dtype)
            bias = bias.clamp(-MAX_TEMPERABLE_LOGIT, MAX_TEMPERABLE_LOGIT)  # 1e308: always
            row = row.index_add(0, tokens, bias)
        return row

    @staticmethod
    def _bad_words_mask(request: SamplingState) -> list[int]:
        """The last token of each bad word whose other tokens end the output so far (a
        one-token word: always)."""
        output = request.output_token_ids
        return [
            last
            for *prefix, last in request.bad_words_token_ids
            if not prefix or output[len(output) - len(prefix) :] == prefix
        ]

    def _sample_random(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray
    ) -> torch.Tensor:
        """Draws the tokens of rows `rows` of `batch` (logits: theirs alone, in order)."""
        temperatures = on_device(batch.temperature[rows], logits.device)
        logits = logits / temperatures[:, None]
        min_p, top_k, top_p = batch.min_p[rows], batch.top_k[rows], batch.top_p[rows]
        if (min_p > 0.0).any():
            logits = apply_min_p(logits, min_p)
        if (top_k > 0).any() or (top_p < 1.0).any():
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        seeded = np.isin(rows, batch.seeded_rows)
        unseeded = np.flatnonzero(~seeded)
        if len(unseeded):
            draws = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
            noise[on_device(unseeded, probs.device)] = draws.exponential_(generator=self.generator)
        for i in np.flatnonzero(seeded).tolist():
            noise[i].exponential_(generator=batch.states[rows[i]].generator)
        return argmax_rows(probs / noise)


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equal ones, as torch.argmax), int64.
    On CPU, float32 through numpy and other dtypes through torch.max's indices: each is
    several times faster than torch.argmax there (for vocabularies of 256 and 50257 alike;
    bfloat16 has no vectorized argmax)."""
    if values.device.type == "cpu":
        if values.dtype == torch.float32:
            return torch.from_numpy(values.numpy().argmax(axis=-1))
        return values.max(dim=-1).indices
    return values.argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: np.ndarray | list[float]) -> torch.Tensor:
    """Masks tokens whose probability is below min_p x the top token's probability."""
    probs = torch.softmax(logits, dim=-1)
    fraction = on_device(min_p, probs.device, probs.dtype)[:, None]
    threshold = probs.max(dim=-1, keepdim=True).values * fraction
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: np.ndarray | list[int], top_p: np.ndarray | list[float]
) -> torch.Tensor:
    """Keeps each row's top_k largest logits (k <= 0: all), then the smallest set of the most
    likely tokens whose probability mass reaches top_p (the top token is always kept)."""
    vocab = logits.shape[1]
    top_k, top_p = np.asarray(top_k, dtype=np.int64), np.asarray(top_p, dtype=np.float32)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = on_device(np.where((top_k > 0) & (top_k < vocab), top_k, vocab), logits.device)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 must keep everything: rounding can push mass_before to 1.0.
    p = on_device(np.where(top_p < 1.0, top_p, np.inf), logits.device)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
