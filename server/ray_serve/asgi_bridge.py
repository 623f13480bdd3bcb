"""Runs one forwarded request through an ASGI app in this process and streams the response
back: the head first, then the body chunks as the app sends them, paced by a `Pacer` (each
item is a message between processes, whose cost, not the bytes, is what a fast stream
multiplies).

The app sees an ordinary HTTP request whose body has arrived. When the caller stops reading
(the stream is cancelled or closed), the next `receive` says `http.disconnect`, a `send`
fails, and the app's task is cancelled, so the request is aborted in the engine wherever it
waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

from octavo.server.ray_serve.messages import ForwardedRequest, ResponseStart
from octavo.server.ray_serve.pacer import Pacer

# What the app's task queues last, once the app has returned or raised: the end of its body,
# so that what it sent before still goes out and then the iterator ends (raising what the
# app raised), whether or not the app finished its response.
_APP_ENDED: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def http_scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        # HTTP spec 2.3: a streaming response listens for http.disconnect on receive (from
        # 2.4 on it would learn of a disconnect only from a send that fails).
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }


async def call_asgi(
    app: ASGIApp,
    request: ForwardedRequest,
    extra_headers: list[tuple[bytes, bytes]],
    batch_interval_s: float = 0.0,
) -> AsyncIterator[ResponseStart | bytes]:
    """Yields the app's ResponseStart (with `extra_headers` added), then its body: the first
    `PACER_BURST` chunks as soon as they are sent, then one item per `batch_interval_s` on
    average, each joining the chunks sent meanwhile; then the app's exception, if it raised
    one. Closing or cancelling the iterator disconnects the app's request."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_taken = False

    async def receive() -> Message:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the caller stopped reading the response")
        await sent.put(message)

    async def run_app() -> None:
        try:
            await app(http_scope(request), receive, send)
        finally:
            sent.put_nowait(_APP_ENDED)

    app_task = asyncio.ensure_future(run_app())
    loop = asyncio.get_running_loop()
    pacer = Pacer(batch_interval_s)
    complete = False
    try:
        while True:
            message = await sent.get()
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), *extra_headers]
                yield ResponseStart(message["status"], headers)
            elif message["type"] == "http.response.body":
                # Chunks the app sends within the interval, or while the last item was in
                # transit, go as one: a fast stream is coalesced, not queued.
                chunks, more = [message.get("body", b"")], message.get("more_body", False)
                if more and (wait := pacer.delay(loop.time())) > 0:
                    await asyncio.sleep(wait)
                while more and not sent.empty():
                    message = sent.get_nowait()
                    chunks.append(message.get("body", b""))
                    more = message.get("more_body", False)
                if body := b"".join(chunks):
                    yield body
                    pacer.sent(loop.time())
                if not more:
                    complete = True
                    return
    finally:
        gone.set()
        if complete:
            await app_task  # it has ended, or only has to return: raises what it raised
        elif not app_task.done():
            # The caller stopped reading: the response is moot. The app is told (a
            # disconnect) and its task cancelled, which closes its engine streams wherever
            # they wait.
            app_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await app_task
