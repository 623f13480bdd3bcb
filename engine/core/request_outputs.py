"""The core's outputs to the front end, built in one place: a request's progress, its final
output (a finish, an abort, a failure, a beam search's end, a refusal) and its prompt
logprobs."""

from __future__ import annotations

from octavo.engine.core.beam_state import normalized_score
from octavo.engine.core.sequence import SequenceGroup
from octavo.engine.core_messages import BeamResult, EngineCoreOutput, PromptLogprobs, SampleDelta
from octavo.engine.sampling_params import BeamSearchParams


def progress_output(
    group: SequenceGroup, samples: list[SampleDelta], first: bool
) -> EngineCoreOutput:
    """What a running request's samples gained in a step. Its first output also says when
    the request was first scheduled and how many prompt tokens the prefix cache held."""
    output = EngineCoreOutput(group.request_id, samples)
    if first:
        output.first_scheduled_time = group.first_scheduled_time
        output.num_cached_tokens = group.num_cached_tokens
    return output


def final_output(group: SequenceGroup, samples: list[SampleDelta]) -> EngineCoreOutput:
    """A finished request's last output: the samples of its last step, an "abort"/"error"
    end for samples that never got one, and a beam search's hypotheses."""
    ended = {s.index for s in samples}
    logprobs = group.sampling_params.logprobs is not None
    for seq in group.seqs:
        if seq.index not in ended and seq.status.finish_reason in ("abort", "error"):
            cumulative = seq.cumulative_logprob if logprobs else None
            # A final_only sample's tokens were held back: its end brings them all.
            tokens = seq.output_token_ids if group.final_only else []
            samples.append(
                SampleDelta(seq.index, tokens, cumulative, None, seq.status.finish_reason)
            )
    return EngineCoreOutput(
        group.request_id,
        samples=samples if group.beam is None else [],
        finished=True,
        error=group.error,
        beams=_beam_results(group) if group.beam is not None else None,
        first_scheduled_time=group.first_scheduled_time,
        first_token_time=group.first_token_time,
        num_cached_tokens=group.num_cached_tokens,
    )


def refused_output(request_id: str, exc: Exception) -> EngineCoreOutput:
    """The final output of a request the core could not take."""
    return EngineCoreOutput(request_id, finished=True, error=f"{type(exc).__name__}: {exc}")


def attach_prompt_logprobs(
    outputs: list[EngineCoreOutput],
    chunks: dict[str, PromptLogprobs],
    groups: dict[str, SequenceGroup],
) -> None:
    """Gives each request's prompt-logprobs chunk of the step to its output of the step, or
    to an output of its own (a prompt still being prefilled has no other); a request that
    ended meanwhile (aborted) gets none."""
    for output in outputs:
        output.prompt_logprobs = chunks.pop(output.request_id, None)
    outputs += [
        EngineCoreOutput(request_id, prompt_logprobs=chunk)
        for request_id, chunk in chunks.items()
        if not groups[request_id].is_finished
    ]


def _beam_results(group: SequenceGroup) -> list[BeamResult]:
    """The best num_return_sequences hypotheses, best first. A search aborted before any
    hypothesis finished reports its live beams, best first, with finish_reason "abort" (or
    "error" for a search that failed)."""
    params, beam = group.sampling_params, group.beam
    assert isinstance(params, BeamSearchParams) and beam is not None
    hypotheses = beam.hypotheses()
    if not hypotheses:
        reason = "abort" if group.error is None else "error"
        hypotheses = [
            BeamResult(
                seq.output_token_ids,
                cumulative,
                normalized_score(cumulative, max(seq.num_output_tokens, 1), params.length_penalty),
                reason,
            )
            for seq, cumulative in zip(group.seqs, beam.running_scores.tolist(), strict=False)
        ]
    return hypotheses[: params.num_return_sequences]
