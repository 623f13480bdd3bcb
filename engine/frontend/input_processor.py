"""Tokenizes and validates requests on the front end, before anything reaches the core."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.engine.core_messages import EngineCoreRequest, ModelLimits
from octavo.engine.errors import ParameterError
from octavo.engine.frontend.tokenizer import Tokenizer
from octavo.engine.lora_request import LoRARequest
from octavo.engine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    BeamSearchParams,
    GenerationParams,
    SamplingParams,
    is_int,
)
from octavo.engine.stop_rules import length_limit, stop_token_set
from octavo.engine.structured_outputs import compile_grammar


@dataclass(frozen=True)
class ProcessedPrompt:
    """A validated prompt: its text (None when given as token ids) and its token ids, with
    what the engine derived from its request's parameters, which stay as the caller made
    them: the llguidance grammar of `structured_outputs` (compiled and validated here; the
    core and the worker read it, never the constraint itself) and the token ids of each of
    `bad_words` (with and without a leading space, by the model's tokenizer)."""

    text: str | None
    token_ids: list[int]
    grammar: str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)


class InputProcessor:
    """Pure checks against the model's limits: any thread or process may call it, and a
    request it passes is one the core can take. Every refusal is a ParameterError (a
    ValueError) naming the offending parameter."""

    def __init__(self, tokenizer: Tokenizer | None, limits: ModelLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def process_inputs(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> ProcessedPrompt:
        text, token_ids = self._tokenize(prompt)
        grammar, bad_words_token_ids = None, []
        keep = params.truncate_prompt_tokens
        if keep is not None and keep < len(token_ids):
            text, token_ids = None, token_ids[-keep:]  # the text is the kept tokens'
        if params.bad_words:
            bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            self._tokenizer_for("structured_outputs")  # the worker masks through its tokens
            grammar = compile_grammar(params.structured_outputs)
        self._validate(token_ids, params, bad_words_token_ids)
        return ProcessedPrompt(text, token_ids, grammar, bad_words_token_ids)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word as tokenized at the start of a text and after a space (the
        second only when it differs in its first token but not in length)."""
        tokenizer = self._tokenizer_for("bad_words")
        found: list[list[int]] = []
        for word in words:
            plain = tokenizer.encode(word.lstrip())
            spaced = tokenizer.encode(" " + word.lstrip())
            found.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                found.append(spaced)
        return found

    def core_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        user: str = "",
    ) -> EngineCoreRequest:
        """The request the core takes: with its stop tokens computed, once, here, and what
        process_inputs derived from its parameters. ParameterError: a priority other than 0
        without the priority policy (vLLM's rule), or one out of range."""
        if not is_int(priority):
            raise ParameterError("priority", f"priority must be an integer, got {priority!r}")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise ParameterError("priority", f"priority must fit in 64 bits, got {priority}")
        if priority and self.limits.scheduling_policy != "priority":
            raise ParameterError(
                "priority",
                f"priority {priority} needs --scheduling-policy priority (this engine "
                f"schedules by {self.limits.scheduling_policy})",
            )
        return EngineCoreRequest(
            request_id,
            prompt.token_ids,
            arrival_time,
            self._stop_token_ids(params),
            sampling_params=params if isinstance(params, SamplingParams) else None,
            beam_params=params if isinstance(params, BeamSearchParams) else None,
            lora_request=lora_request,
            grammar=prompt.grammar,
            bad_words_token_ids=prompt.bad_words_token_ids,
            priority=priority,
            user=user,
        )

    def _stop_token_ids(self, params: GenerationParams) -> list[int]:
        return stop_token_set(params.stop_token_ids, params.ignore_eos, self.limits.eos_token_ids)

    def _tokenizer_for(self, param: str, hint: str = "") -> Tokenizer:
        """The tokenizer `param` needs; ParameterError naming it for a model without one."""
        if self.tokenizer is None:
            raise ParameterError(param, f"{param}: this model has no tokenizer.json{hint}")
        return self.tokenizer

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._tokenizer_for("prompt", "; pass token ids").encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(map(is_int, prompt)):
            raise ParameterError("prompt", "prompt must be a string or a list of integer token ids")
        return None, list(prompt)

    def _validate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        bad_words_token_ids: list[list[int]],
    ) -> None:
        limits = self.limits
        if not prompt_ids:
            raise ParameterError("prompt", "prompt must not be empty")
        vocab = limits.vocab_size
        self._check_in_vocab("prompt", "prompt token ids", prompt_ids)
        if len(prompt_ids) > limits.max_model_len:
            raise ParameterError(
                "prompt",
                f"prompt is {len(prompt_ids)} tokens, longer than "
                f"max_model_len ({limits.max_model_len})",
            )
        self._check_in_vocab("stop_token_ids", "stop_token_ids", params.stop_token_ids)
        if isinstance(params, BeamSearchParams):
            width = "beam_width"
            if max(2, 1 + len(self._stop_token_ids(params))) * params.beam_width > vocab:
                raise ParameterError(
                    "beam_width",
                    f"beam_width={params.beam_width} ranks more "
                    f"candidates per step than the vocabulary ({vocab}) has",
                )
        else:
            width = "n" if params.best_of is None else "best_of"
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > vocab:
                    raise ParameterError(name, f"{name} must be <= the vocabulary size {vocab}")
            for name, ids in (
                ("logit_bias", list(params.logit_bias or ())),
                ("allowed_token_ids", params.allowed_token_ids or []),
                # A tokenizer may know more tokens than the model: never index past its logits.
                ("bad_words", [t for word in bad_words_token_ids for t in word]),
            ):
                self._check_in_vocab(name, f"{name} token ids", ids)
        num_seqs = params.num_sequences
        if num_seqs > limits.max_num_seqs:
            raise ParameterError(
                width,
                f"{width}={num_seqs} exceeds max_num_seqs "
                f"({limits.max_num_seqs}): its sequences run together",
            )
        # Each group must fit alone even after a preemption undoes its prompt sharing.
        longest = length_limit(len(prompt_ids), params.max_tokens, limits.max_model_len)
        blocks = num_seqs * -(-longest // limits.block_size)
        if blocks > limits.num_usable_blocks:
            raise ParameterError(
                width,
                f"{width}={num_seqs} sequences of up to {longest} tokens need "
                f"{blocks} KV blocks; the cache has {limits.num_usable_blocks}",
            )

    def _check_in_vocab(self, name: str, what: str, token_ids: list[int]) -> None:
        """Refuses (`name`; "`what` must be in ...") token ids the model has no logit for.
        Only a prompt's can be negative: the parameters refuse negative ids themselves."""
        vocab = self.limits.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ParameterError(name, f"{what} must be in [0, {vocab}), got {bad[:4]}")
