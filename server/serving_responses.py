"""POST /v1/responses (stateless): a Responses request completed as the chat request it
amounts to (responses_protocol.py), answered as a response object or as a stream of the
Responses API's events."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from octavo.engine.frontend.outputs import RequestOutput
from octavo.server.errors import APIError
from octavo.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseError,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    function_call_id,
    message_id,
    response_id,
    responses_message,
    responses_param,
)
from octavo.server.serving_chat import ChatServing
from octavo.server.serving_engine import (
    PromptAndParams,
    engine_error,
    json_unless_disconnected,
    usage,
)
from octavo.server.streaming import EventStreamResponse
from octavo.server.tool_calls import MessageDelta

# What a stream's events are handed to: the event's type and its fields.
Emit = Callable[[str, dict[str, Any]], None]
MAX_OUTPUT_TOKENS = IncompleteDetails(reason="max_output_tokens")
ABORTED = ResponseError(code="server_error", message="the response was aborted before it ended")


class ResponsesServing(ChatServing):
    """The Responses route over the chat machinery: a request's chat request is checked,
    rendered by the chat template and processed as a chat request is, then completed as one
    engine request (one choice), whose text the request's tool-call parser reads into output
    items (`OutputItems`). Errors name the Responses fields (`in_responses_terms`). The
    route's handler is `create_response` (the inherited `create` answers chat requests)."""

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """The response to one request; a non-streamed request whose client disconnects is
        aborted like a stream whose client left."""
        template = self.config.chat_template
        if template is None:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "this model has no chat template, so it cannot serve /v1/responses: start the "
                "server with --chat-template FILE_OR_STRING (a Jinja chat template), or use "
                "/v1/completions",
            )
        chat = request.chat_request()
        try:
            self._check_supported(chat)
            await self.compile_constraint(chat)
            prompts = [self.process(chat, self._render(template, chat))]
        except APIError as exc:
            raise in_responses_terms(exc) from exc
        id_, created_at = response_id(), int(time.time())
        streams = self.submit(id_, prompts, chat.model)
        if chat.stream:
            stream = ResponseStream(self, request, id_, created_at, prompts)
            return EventStreamResponse(stream.events(self.merge(streams)))
        work = self._complete_response(request, id_, created_at, prompts, streams)
        return await json_unless_disconnected(raw_request, work)

    async def _complete_response(
        self,
        request: ResponsesRequest,
        id_: str,
        created_at: int,
        prompts: list[PromptAndParams],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> ResponsesResponse:
        final: RequestOutput | None = None
        try:
            async for _, output in self.merge(streams):
                final = output
        except Exception as exc:
            raise in_responses_terms(engine_error(exc)) from exc
        assert final is not None and final.finished
        if final.metrics is not None:
            self.metrics.observe_finished(final.metrics)
        [completion] = final.outputs
        parser = self.tool_parser(request.chat_request())
        items = OutputItems()
        items.read(parser.feed(completion.text))
        items.read(parser.finish())
        state = final_state(completion.finish_reason)
        items.close(item_status(state))
        return ResponsesResponse.of(
            request,
            id_,
            created_at,
            request.model,
            output=items.items,
            usage=responses_usage(prompts, len(completion.token_ids), final.num_cached_tokens),
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


def item_status(state: dict[str, Any]) -> str:
    """The status of the item a response ended in: cut short unless it completed."""
    return "completed" if state["status"] == "completed" else "incomplete"


def responses_usage(
    prompts: list[PromptAndParams], output_tokens: int, cached_tokens: int | None
) -> ResponseUsage:
    counts = usage(prompts, output_tokens, cached_tokens or 0)
    return ResponseUsage(
        input_tokens=counts.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens or 0),
        output_tokens=counts.completion_tokens,
        total_tokens=counts.total_tokens,
    )


class OutputItems:
    """A response's output items, built as a tool-call parser reads its text (`read` each
    MessageDelta, then `close`): content goes to a message item (one output_text part) and
    each call to a function_call item, in the order they come; an item is done when the next
    one begins, or at `close` (with the response's status). Within one delta, content comes
    before calls, so a non-streamed response (one delta) has its text first.

    `emit`, when given, hears the stream events of each step, with the item dicts as they
    stand (it must encode them at once: they grow)."""

    def __init__(self, emit: Emit | None = None):
        self.items: list[dict[str, Any]] = []  # JSON-ready, in the response's shape
        self._emit = emit
        self._open: dict[str, Any] | None = None  # the last item, while it grows
        self._pieces: list[str] = []  # its text or arguments so far
        self._call_index = -1  # the parser's index of the open call

    def read(self, delta: MessageDelta) -> None:
        if delta.content:
            if self._open is None or self._open["type"] != "message":
                self._begin({"type": "message", "id": message_id(), "status": "in_progress",
                             "role": "assistant", "content": []})  # fmt: skip
            self._pieces.append(delta.content)
            self._send("response.output_text.delta", content_index=0, delta=delta.content,
                       logprobs=[])  # fmt: skip
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its id and name come first
                self._begin({"type": "function_call", "id": function_call_id(),
                             "call_id": call.id, "name": call.name or "", "arguments": "",
                             "status": "in_progress"})  # fmt: skip
                self._call_index = call.index
            assert call.index == self._call_index, "a parser's fragments extend its last call"
            if call.arguments:
                self._pieces.append(call.arguments)
                self._send("response.function_call_arguments.delta", delta=call.arguments)

    def close(self, status: str) -> None:
        """Ends the last item with `status` ("incomplete": the output was cut short)."""
        self._end(status)

    def _begin(self, item: dict[str, Any]) -> None:
        self._end("completed")
        self._open = item
        self.items.append(item)
        if self._emit is not None:
            self._emit(
                "response.output_item.added", {"output_index": len(self.items) - 1, "item": item}
            )
            if item["type"] == "message":
                self._send("response.content_part.added", content_index=0, part=_text_part(""))

    def _end(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(self._pieces)
        self._pieces = []
        if item["type"] == "message":
            item["content"] = [_text_part(text)]
        else:
            item["arguments"] = text
        item["status"] = status
        if self._emit is None:
            return
        if item["type"] == "message":
            self._send("response.output_text.done", content_index=0, text=text, logprobs=[],
                       item=item)  # fmt: skip
            self._send("response.content_part.done", content_index=0, part=item["content"][0],
                       item=item)  # fmt: skip
        else:
            self._send("response.function_call_arguments.done", name=item["name"],
                       arguments=text, item=item)  # fmt: skip
        self._emit("response.output_item.done", {"output_index": len(self.items) - 1, "item": item})

    def _send(self, type_: str, item: dict[str, Any] | None = None, **fields: Any) -> None:
        """An event about the open item (or `item`, as it ends): its id and index first."""
        if self._emit is None:
            return
        item = item if item is not None else self._open
        assert item is not None
        self._emit(type_, {"item_id": item["id"], "output_index": len(self.items) - 1, **fields})


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class ResponseStream:
    """One streamed response, as the bytes its EventStreamResponse sends: response.created
    and response.in_progress at once, then the output items' events as the engine's outputs
    arrive (`OutputItems`), then response.completed (or response.incomplete, response.failed:
    `final_state`) carrying the whole response. Each event is `event: <type>` and
    `data: <JSON>` with a sequence_number (0, 1, ...); the events of one output leave in one
    item. No `[DONE]` follows: OpenAI sends none.

    An exception from the outputs ends the stream with an `error` event and response.failed
    (the item it cut short incomplete), never a cut-off stream. Closing the stream (a client
    that went away) closes the outputs, which aborts the request."""

    def __init__(
        self,
        serving: ResponsesServing,
        request: ResponsesRequest,
        id_: str,
        created_at: int,
        prompts: list[PromptAndParams],
    ):
        self.serving = serving
        self.request = request
        self.id = id_
        self.created_at = created_at
        self.prompts = prompts
        self.items = OutputItems(self._event)
        self._encoder = msgspec.json.Encoder()
        self._sequence_number = 0
        self._pending: list[bytes] = []  # encoded events not yet sent

    async def events(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncGenerator[bytes, None]:
        """The stream of `outputs` (`EngineServing.merge`'s, of one engine request)."""
        opening = self._response(status="in_progress")
        self._event("response.created", {"response": opening})
        self._event("response.in_progress", {"response": opening})
        yield self._flush()
        parser = self.serving.tool_parser(self.request.chat_request())
        output_tokens, cached_tokens, finish_reason = 0, None, None
        try:
            # Closed here, not when collected: its close aborts the request. (`merge` is an
            # async generator, annotated as the iterator it is to its other readers.)
            async with contextlib.aclosing(outputs):  # type: ignore[type-var]
                async for _, output in outputs:
                    if output.num_cached_tokens is not None:
                        cached_tokens = output.num_cached_tokens
                    for completion in output.outputs:
                        output_tokens += len(completion.token_ids)
                        self.items.read(parser.feed(completion.text))
                        if completion.finish_reason is not None:
                            self.items.read(parser.finish())
                            finish_reason = completion.finish_reason
                    if output.finished and output.metrics is not None:
                        self.serving.metrics.observe_finished(output.metrics)
                    if self._pending:
                        yield self._flush()
        except Exception as exc:  # the client still sees the stream end, with the error
            error = in_responses_terms(engine_error(exc))
            self.items.close("incomplete")
            self._event(
                "error",
                {"code": error.body().error.type, "message": error.message, "param": error.param},
            )
            failure = ResponseError(code="server_error", message=error.message)
            failed = self._response(status="failed", error=failure, output=self.items.items)
            self._event("response.failed", {"response": failed})
            yield self._flush()
            return
        state = final_state(finish_reason)
        self.items.close(item_status(state))
        response = self._response(
            output=self.items.items,
            usage=responses_usage(self.prompts, output_tokens, cached_tokens),
            **state,
        )
        self._event(f"response.{state['status']}", {"response": response})
        yield self._flush()

    def _response(self, **state: Any) -> dict[str, Any]:
        """The response object as it stands (`state`: status, output, ...), JSON-ready."""
        model = self.request.model  # the base's name, or an adapter's
        response = ResponsesResponse.of(self.request, self.id, self.created_at, model, **state)
        return response.model_dump(mode="json")

    def _event(self, type_: str, fields: dict[str, Any]) -> None:
        event = {"type": type_, **fields, "sequence_number": self._sequence_number}
        self._sequence_number += 1
        data = self._encoder.encode(event)
        self._pending.append(b"event: %s\ndata: %s\n\n" % (type_.encode(), data))

    def _flush(self) -> bytes:
        sent = b"".join(self._pending)
        self._pending.clear()
        return sent
