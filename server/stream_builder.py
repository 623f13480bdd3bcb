"""The SSE events of a streamed completion or chat completion: one builder for both routes,
which differ only in the chunk an output makes (`StreamBuilder.delta_chunk`)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.protocol import GenerationRequest, Usage
from octavo.server.serving_engine import EngineServing, PromptAndParams, engine_error, usage
from octavo.server.stream_chunks import ChatCompletionChunk, CompletionChunk, jsonable
from octavo.server.streaming import SSE_DONE, sse_event

ServingT = TypeVar("ServingT", bound=EngineServing)
RequestT = TypeVar("RequestT", bound=GenerationRequest)
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


class StreamBuilder(ABC, Generic[ServingT, RequestT, ChunkT]):
    """One streamed response, as the bytes its EventStreamResponse sends: the opening chunks
    (`opening`), then per output of the engine one event for each choice that progressed
    (`delta_chunk` makes its chunk; with stream_options.continuous_usage_stats it carries
    the choice's usage so far), then with stream_options.include_usage a chunk of the
    whole usage and no choices, then [DONE]. The events of one output leave in one item,
    as do the usage event and [DONE].

    A request of k prompts and n samples has k output streams, merged: choice `i * n + j`
    is sample j of prompt i. An exception from the outputs ends the stream with an error
    event and [DONE], never a cut-off stream. Closing the stream (a client that went away)
    drops the outputs' generator, whose streams abort their requests."""

    chunk_type: type[ChunkT]  # the route's chunk: CompletionChunk or ChatCompletionChunk

    def __init__(
        self,
        serving: ServingT,
        request_id: str,
        request: RequestT,
        prompts: list[PromptAndParams],
    ):
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.created = int(time.time())
        self.model = request.model  # the base's name, or an adapter's
        self.prompts = prompts
        options = request.stream_options
        self.include_usage = options is not None and options.include_usage
        self.continuous_usage = (
            self.include_usage and options is not None and options.continuous_usage_stats
        )
        self.choices: dict[int, ChoiceState] = {}
        self.cached_tokens: dict[int, int] = {}  # per prompt, from the prefix cache

    def chunk(self, choices: list) -> ChunkT:
        """A chunk of this stream with `choices` (the chunk type's choices)."""
        return self.chunk_type(
            id=self.request_id, created=self.created, model=self.model, choices=choices
        )

    def opening(self) -> list[ChunkT]:
        """The chunks sent before any output: none, unless the route has some."""
        return []

    @abstractmethod
    def delta_chunk(
        self, output: RequestOutput, completion: CompletionOutput, choice: ChoiceState
    ) -> ChunkT:
        """The chunk of `completion`, what `choice` gained (a delta output of its request,
        `output`); `choice.started` is False for its first. Adds the completion tokens it
        returns to `choice.tokens`, and moves `choice.text_offset` past the text of the
        tokens whose logprobs it carries."""

    async def events(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncGenerator[bytes, None]:
        """The stream of `outputs` (`EngineServing.merge`'s: prompt index, delta output)."""
        event = self.serving.events.event
        opening = self.opening()
        if opening:
            yield b"".join(event(chunk) for chunk in opening)
        n = self.request.n
        try:
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
                    chunk = self.delta_chunk(output, completion, choice)
                    choice.started = True  # after the hook: it tells a choice's first chunk
                    if self.continuous_usage:
                        chunk.usage = jsonable(
                            Usage(
                                prompt_tokens=choice.prompt_tokens,
                                completion_tokens=choice.tokens,
                                total_tokens=choice.prompt_tokens + choice.tokens,
                            )
                        )
                    events.append(event(chunk))
                if output.finished and output.metrics is not None:
                    self.serving.metrics.observe_finished(output.metrics)
                if events:
                    yield b"".join(events)
            if self.include_usage:
                completion_tokens = sum(choice.tokens for choice in self.choices.values())
                total = usage(self.prompts, completion_tokens, sum(self.cached_tokens.values()))
                chunk = self.chunk([])
                chunk.usage = jsonable(total)
                yield event(chunk) + SSE_DONE
                return
        except Exception as exc:  # the client still sees the stream end, with the error
            yield sse_event(engine_error(exc).body()) + SSE_DONE
            return
        yield SSE_DONE
