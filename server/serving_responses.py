"""POST /v1/responses (stateless): a Responses request completed as the chat request it
amounts to (responses_protocol.py), answered as a response object or as a stream of the
Responses API's events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.errors import APIError
from octavo.server.metrics import ServerMetrics
from octavo.server.protocol import Usage
from octavo.server.responses_protocol import (
    FunctionToolCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    function_call_id,
    message_id,
    responses_message,
    responses_param,
)
from octavo.server.serving_chat import ChatServing
from octavo.server.serving_engine import (
    EngineServing,
    Generation,
    PromptAndParams,
    ServerConfig,
    usage,
)
from octavo.server.stream_builder import ChoiceState, StreamBuilder
from octavo.server.tool_calls import MessageDelta

# What a stream's events are handed to: the event's type and its fields.
Emit = Callable[[str, dict[str, Any]], None]
MAX_OUTPUT_TOKENS = IncompleteDetails(reason="max_output_tokens")
ABORTED = ResponseError(code="server_error", message="the response was aborted before it ended")


class ResponseStream(StreamBuilder["ResponsesServing", ResponsesRequest]):
    """One streamed response: response.created and response.in_progress at once, then the
    output items' events as the engine's outputs arrive (`OutputItems`), then
    response.completed (or response.incomplete, response.failed: `final_state`) carrying the
    whole response. Each event is `event: <type>` and `data: <JSON>` with a sequence_number
    (0, 1, ...). No `[DONE]` follows: OpenAI sends none. An exception from the outputs is an
    `error` event and response.failed (the item it cut short incomplete)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.items = OutputItems(self._event)
        self._parser = self.serving.chat.tool_parser(self.request.chat_request())
        self._finish_reason: str | None = None
        self._sequence_number = 0
        self._pending: list[bytes] = []  # encoded events not yet sent

    def opening(self) -> bytes:
        opening = self._response(status="in_progress")
        self._event("response.created", {"response": opening})
        self._event("response.in_progress", {"response": opening})
        return self._flush()

    def delta_events(
        self, output: RequestOutput, completion: CompletionOutput, choice: ChoiceState
    ) -> bytes:
        choice.tokens += len(completion.token_ids)
        self.items.read(self._parser.feed(completion.text))
        if completion.finish_reason is not None:
            self.items.read(self._parser.finish())
            self._finish_reason = completion.finish_reason
        return self._flush()

    def closing(self) -> bytes:
        state = final_state(self._finish_reason)
        self.items.close(state["status"])
        response = self._response(
            output=self.items.items, usage=responses_usage(self.usage()), **state
        )
        self._event(f"response.{state['status']}", {"response": response})
        return self._flush()

    def failure(self, error: APIError) -> bytes:
        error = in_responses_terms(error)
        self.items.close("failed")
        self._event(
            "error",
            {"code": error.body().error.type, "message": error.message, "param": error.param},
        )
        failure = ResponseError(code="server_error", message=error.message)
        failed = self._response(status="failed", error=failure, output=self.items.items)
        self._event("response.failed", {"response": failed})
        return self._flush()

    def _response(self, **state: Any) -> ResponsesResponse:
        """The response object as it stands (`state`: status, output, ...)."""
        return ResponsesResponse.of(self.request, self.request_id, self.created, **state)

    def _event(self, type_: str, fields: dict[str, Any]) -> None:
        event = {"type": type_, **fields, "sequence_number": self._sequence_number}
        self._sequence_number += 1
        self._pending.append(self.event(event, type_))

    def _flush(self) -> bytes:
        sent = b"".join(self._pending)
        self._pending.clear()
        return sent


class ResponsesServing(EngineServing[ResponsesRequest]):
    """The Responses route over the chat machinery: a request's chat request is checked,
    rendered by the chat template and processed as the chat route does it (`self.chat`),
    then completed as one engine request (one choice), whose text the request's tool-call
    parser reads into output items (`OutputItems`). Errors name the Responses fields
    (`in_responses_terms`)."""

    id_prefix = "resp_"
    stream_type = ResponseStream

    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        super().__init__(engine, config, metrics)
        self.chat = ChatServing(engine, config, metrics)

    async def create_responses(self, request: ResponsesRequest, raw_request: Request) -> Response:
        try:
            return await self.serve(request, raw_request)
        except APIError as exc:
            raise in_responses_terms(exc) from exc

    async def preprocess(self, request: ResponsesRequest) -> list[PromptAndParams]:
        return await self.chat.preprocess(request.chat_request(), "/v1/responses")

    def response(
        self, generation: Generation[ResponsesRequest], finals: list[RequestOutput]
    ) -> ResponsesResponse:
        request = generation.request
        [final] = finals
        [completion] = final.outputs
        parser = self.chat.tool_parser(request.chat_request())
        items = OutputItems()
        items.read(parser.feed(completion.text))
        items.read(parser.finish())
        state = final_state(completion.finish_reason)
        items.close(state["status"])
        counts = usage(generation.prompts, len(completion.token_ids), final.num_cached_tokens or 0)
        return ResponsesResponse.of(
            request,
            generation.request_id,
            generation.created,
            output=items.items,
            usage=responses_usage(counts),
            **state,
        )


def in_responses_terms(exc: APIError) -> APIError:
    """A chat request's error, naming the Responses fields the client sent."""
    return APIError(
        exc.status,
        responses_message(exc.message),
        param=responses_param(exc.param),
        code=exc.code,
        headers=exc.headers,
    )


def final_state(finish_reason: str | None) -> dict[str, Any]:
    """The status of a response whose output ended with `finish_reason`, with its details:
    "incomplete" at the token limit, "failed" when the engine aborted it (the server is
    shutting down), else "completed"."""
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": MAX_OUTPUT_TOKENS}
    if finish_reason == "abort":
        return {"status": "failed", "error": ABORTED}
    return {"status": "completed"}


def responses_usage(counts: Usage) -> ResponseUsage:
    """Token counts in the Responses API's terms."""
    assert counts.prompt_tokens_details is not None, "usage() counts the cached tokens"
    cached_tokens = counts.prompt_tokens_details.cached_tokens
    return ResponseUsage(
        input_tokens=counts.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens=counts.completion_tokens,
        total_tokens=counts.total_tokens,
    )


class OutputItems:
    """A response's output items, built as a tool-call parser reads its text (`read` each
    MessageDelta, then `close`): content goes to a message item (one output_text part) and
    each call to a function_call item, in the order they come; an item is done when the next
    one begins, or at `close` (with the response's status). Within one delta, content comes
    before calls, so a non-streamed response (one delta) has its text first.

    `emit` hears the stream events of each step, with the items as they stand (it must
    encode them at once: they grow); by default nobody does (a non-streamed response)."""

    def __init__(self, emit: Emit = lambda type_, fields: None):
        self.items: list[OutputMessage | FunctionToolCall] = []
        self._emit = emit
        self._open: OutputMessage | FunctionToolCall | None = None  # the last, while it grows
        self._pieces: list[str] = []  # its text or arguments so far
        self._call_index = -1  # the parser's index of the open call

    def read(self, delta: MessageDelta) -> None:
        if delta.content:
            if not isinstance(self._open, OutputMessage):
                self._begin(OutputMessage(id=message_id(), status="in_progress", content=[]))
            self._pieces.append(delta.content)
            self._send("response.output_text.delta", content_index=0, delta=delta.content,
                       logprobs=[])  # fmt: skip
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its id and name come first
                self._begin(FunctionToolCall(id=function_call_id(), call_id=call.id,
                                             name=call.name or "", arguments="",
                                             status="in_progress"))  # fmt: skip
                self._call_index = call.index
            assert call.index == self._call_index, "a parser's fragments extend its last call"
            if call.arguments:
                self._pieces.append(call.arguments)
                self._send("response.function_call_arguments.delta", delta=call.arguments)

    def close(self, status: str) -> None:
        """Ends the last item as a response of `status` ends it: completed when the response
        completed (or the next item began), else incomplete (the output was cut short)."""
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(self._pieces)
        self._pieces = []
        item.status = "completed" if status == "completed" else "incomplete"
        if isinstance(item, OutputMessage):
            item.content = [OutputText(text=text)]
            self._send("response.output_text.done", content_index=0, text=text, logprobs=[],
                       item=item)  # fmt: skip
            self._send("response.content_part.done", content_index=0, part=item.content[0],
                       item=item)  # fmt: skip
        else:
            item.arguments = text
            self._send("response.function_call_arguments.done", name=item.name,
                       arguments=text, item=item)  # fmt: skip
        self._emit("response.output_item.done", {"output_index": len(self.items) - 1, "item": item})

    def _begin(self, item: OutputMessage | FunctionToolCall) -> None:
        self.close("completed")
        self._open = item
        self.items.append(item)
        self._emit(
            "response.output_item.added", {"output_index": len(self.items) - 1, "item": item}
        )
        if isinstance(item, OutputMessage):
            self._send("response.content_part.added", content_index=0, part=OutputText(text=""))

    def _send(self, type_: str, item: OutputMessage | FunctionToolCall | None = None,
              **fields: Any) -> None:  # fmt: skip
        """An event about the open item (or `item`, as it ends): its id and index first."""
        item = item if item is not None else self._open
        assert item is not None
        self._emit(type_, {"item_id": item.id, "output_index": len(self.items) - 1, **fields})
