"""The events of a streamed response: one loop over the engine's outputs for every
generating route (`StreamBuilder`), and the chunk streams of completions and chat
(`ChunkStream`), which differ only in the chunk an output makes."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Generic, TypeVar

from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.errors import APIError
from octavo.server.protocol import GenerationRequest, StreamOptions, Usage
from octavo.server.serving_engine import (
    EngineServing,
    Generation,
    RequestT,
    engine_error,
    usage,
)
from octavo.server.stream_chunks import ChatCompletionChunk, CompletionChunk
from octavo.server.streaming import SSE_DONE

ServingT = TypeVar("ServingT", bound=EngineServing)
GenerationRequestT = TypeVar("GenerationRequestT", bound=GenerationRequest)
ChunkT = TypeVar("ChunkT", CompletionChunk, ChatCompletionChunk)


@dataclass(slots=True)
class ChoiceState:
    """Where one choice of a stream stands between its events."""

    index: int  # the choice's index in the response
    prompt_tokens: int  # its prompt's length (continuous usage)
    tokens: int = 0  # completion tokens sent so far
    # Where its next token's text starts in its logprobs text (completions: the token texts
    # laid end to end, as in a whole response; held-back text does not shift it).
    text_offset: int = 0
    started: bool = False  # whether its first event is out


class StreamBuilder(ABC, Generic[ServingT, RequestT]):
    """One streamed response, as the bytes its EventStreamResponse sends: the `opening`
    events, then per output of the engine the events of each choice that progressed
    (`delta_events`), then the `closing` events. The opening, the events of one output and
    the closing each leave in one item. An exception from the outputs ends the stream with
    the `failure` events of its error, never a cut-off stream. Closing the stream (a client
    that went away) closes the outputs, which aborts their requests.

    A request of k prompts and n samples has k output streams, merged: choice `i * n + j`
    is sample j of prompt i."""

    def __init__(self, serving: ServingT, generation: Generation[RequestT]):
        self.serving = serving
        self.request = generation.request
        self.request_id = generation.request_id
        self.created = generation.created
        self.prompts = generation.prompts
        self.n = 1  # samples per prompt
        self.event = serving.events.event
        self.choices: dict[int, ChoiceState] = {}
        self.cached_tokens: dict[int, int] = {}  # per prompt, from the prefix cache

    def opening(self) -> bytes:
        """The events sent before any output: none, unless the route has some."""
        return b""

    @abstractmethod
    def delta_events(
        self, output: RequestOutput, completion: CompletionOutput, choice: ChoiceState
    ) -> bytes:
        """The events of `completion`, what `choice` gained (a delta output of its request,
        `output`), possibly none; `choice.started` is False for its first. Adds the
        completion tokens it returns to `choice.tokens`."""

    @abstractmethod
    def closing(self) -> bytes:
        """The events that end a stream whose outputs all came."""

    @abstractmethod
    def failure(self, error: APIError) -> bytes:
        """The events that end a stream whose outputs ended in `error`."""

    def usage(self) -> Usage:
        """The token counts of every choice so far."""
        completion_tokens = sum(choice.tokens for choice in self.choices.values())
        return usage(self.prompts, completion_tokens, sum(self.cached_tokens.values()))

    async def events(
        self, outputs: AsyncGenerator[tuple[int, RequestOutput], None]
    ) -> AsyncGenerator[bytes, None]:
        """The stream of `outputs` (`EngineServing.merge`'s: prompt index, delta output)."""
        opening = self.opening()
        if opening:
            yield opening
        n = self.n
        try:
            # Closed here, not when collected: its close aborts the requests.
            async with contextlib.aclosing(outputs):
                async for index, output in outputs:
                    if output.num_cached_tokens is not None:
                        self.cached_tokens[index] = output.num_cached_tokens
                    events = []
                    for completion in output.outputs:
                        choice_index = index * n + completion.index
                        choice = self.choices.get(choice_index)
                        if choice is None:
                            prompt_tokens = len(self.prompts[index][0].token_ids)
                            choice = self.choices[choice_index] = ChoiceState(
                                choice_index, prompt_tokens
                            )
                        delta = self.delta_events(output, completion, choice)
                        choice.started = True  # after the hook: it tells a choice's first
                        if delta:
                            events.append(delta)
                    if output.finished and output.metrics is not None:
                        self.serving.metrics.observe_finished(output.metrics)
                    if events:
                        yield b"".join(events)
            closing = self.closing()
        except Exception as exc:  # the client still sees the stream end, with the error
            yield self.failure(engine_error(exc))
            return
        yield closing


class ChunkStream(
    StreamBuilder[ServingT, GenerationRequestT], Generic[ServingT, GenerationRequestT, ChunkT]
):
    """A completions or chat stream: one `data: <chunk>` event per delta output of a choice
    (with stream_options.continuous_usage_stats, carrying the choice's usage so far), then
    with stream_options.include_usage a chunk of the whole usage and no choices, then
    [DONE]. An error is an event of its own, then [DONE]."""

    chunk_type: type[ChunkT]  # the route's chunk: CompletionChunk or ChatCompletionChunk

    def __init__(self, serving: ServingT, generation: Generation[GenerationRequestT]):
        super().__init__(serving, generation)
        request = generation.request
        self.n = request.n
        self.model = request.model  # the base's name, or an adapter's
        options = request.stream_options or StreamOptions()
        self.include_usage = options.include_usage
        self.continuous_usage = options.include_usage and options.continuous_usage_stats

    def chunk(self, choices: list, choice: ChoiceState | None = None) -> ChunkT:
        """A chunk of this stream with `choices` (the chunk type's), the usage of `choice`
        so far when the stream reports it with every chunk."""
        chunk = self.chunk_type(
            id=self.request_id, created=self.created, model=self.model, choices=choices
        )
        if choice is not None and self.continuous_usage:
            chunk.usage = Usage(
                prompt_tokens=choice.prompt_tokens,
                completion_tokens=choice.tokens,
                total_tokens=choice.prompt_tokens + choice.tokens,
            )
        return chunk

    def closing(self) -> bytes:
        if not self.include_usage:
            return SSE_DONE
        chunk = self.chunk([])
        chunk.usage = self.usage()
        return self.event(chunk) + SSE_DONE

    def failure(self, error: APIError) -> bytes:
        return self.event(error.body()) + SSE_DONE
