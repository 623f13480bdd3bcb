"""Server-sent events: the response that carries them, and their framing (`EventEncoder`),
which every stream of the server shares."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from pydantic_core import to_jsonable_python
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# What ends a completions or chat stream (the Responses API sends none).
SSE_DONE = b"data: [DONE]\n\n"


class EventEncoder:
    """Frames payloads as SSE events, as bytes: `data: <JSON>` and a blank line, after an
    `event: <type>` line when the event names its type (the Responses API's).

    The JSON is msgspec's: a stream's chunks are msgspec Structs, encoded in well under a
    microsecond; a pydantic model (the parts only some events carry: logprobs, usage, an
    error, a response object) is encoded as its JSON-ready data, the bytes pydantic's own
    serializer writes."""

    def __init__(self) -> None:
        self._encode = msgspec.json.Encoder(enc_hook=to_jsonable_python).encode

    def event(self, payload: Any, type_: str | None = None) -> bytes:
        data = self._encode(payload)
        if type_ is None:
            return b"data: %s\n\n" % data
        return b"event: %s\ndata: %s\n\n" % (type_.encode(), data)


class EventStreamResponse(Response):
    """An SSE response: each item of `events` (one or more whole events, as bytes) goes out
    in one `send`.

    The items are written by a task of their own: a task wakes up through every coroutine
    it awaits, and the route's task awaits some ten deep (uvicorn's cycle, the middleware),
    which every event would otherwise pay for. The route's task waits for the writer to end
    or for the client's `http.disconnect`, which cancels the writer. The event generator is
    closed however the response ends, at once (its `finally` is what aborts the request in
    the engine), not left to the garbage collector."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]):
        # Response.__init__ would render an empty body and announce its length (0).
        self.status_code = 200
        self.background = None
        self.init_headers()
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.create_task(self._write(send))
        listener = asyncio.create_task(until_disconnect(receive))
        try:
            await asyncio.wait((writer, listener), return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():  # the client left
                writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        finally:  # the writer must be done before its generator can be closed
            writer.cancel()
            listener.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
            await self._events.aclose()

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the request's body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
