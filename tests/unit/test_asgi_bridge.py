"""call_asgi: an ASGI app's response streamed back head first; a caller that stops reading
ends the app's work (what aborts a request in a Ray Serve replica's engine)."""

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from octavo.server.ray_serve.asgi_bridge import call_asgi
from octavo.server.ray_serve.messages import ForwardedRequest, ResponseStart

EXTRA = [(b"x-extra", b"1")]


def make_app(log: list[str]) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": (await request.json())["n"], "q": request.url.query})

    async def stream(_: Request) -> StreamingResponse:
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
                log.append("finished")
            finally:
                log.append("closed")

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)])


def forwarded(path: str, body: bytes = b"", query: bytes = b"") -> ForwardedRequest:
    headers = [(b"content-type", b"application/json"), (b"host", b"test")]
    return ForwardedRequest("POST" if body else "GET", path, query, headers, body, None)


def test_a_response_comes_back_head_first_with_the_extra_headers():
    async def run():
        items = [
            i async for i in call_asgi(make_app([]), forwarded("/echo", b'{"n": 7}', b"a=1"), EXTRA)
        ]
        start, *body = items
        assert isinstance(start, ResponseStart) and start.status == 200
        assert (b"x-extra", b"1") in start.headers
        assert b"".join(body) == b'{"got":7,"q":"a=1"}'

    asyncio.run(run())


def test_a_caller_that_stops_reading_ends_the_apps_stream():
    log: list[str] = []

    async def run():
        stream = call_asgi(make_app(log), forwarded("/stream"), EXTRA)
        assert isinstance(await anext(stream), ResponseStart)
        assert (await anext(stream)).startswith(b"data: 0")
        await stream.aclose()

    asyncio.run(run())
    assert log == ["closed"]  # the app's generator was closed, never ran to the end
