"""call_asgi: an ASGI app's response streamed back head first; a caller that stops reading
ends the app's work (what aborts a request in a Ray Serve replica's engine)."""

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from octavo.server.ray_serve.asgi_bridge import call_asgi
from octavo.server.ray_serve.messages import ForwardedRequest, ResponseStart
from octavo.server.ray_serve.pacer import PACER_BURST

EXTRA = [(b"x-extra", b"1")]


def make_app(log: list[str], period_s: float = 0.01, count: int = 1000) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": (await request.json())["n"], "q": request.url.query})

    async def stream(_: Request) -> StreamingResponse:
        async def events():
            try:
                for i in range(count):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(period_s)
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


def test_a_fast_stream_is_paced_to_one_item_per_interval_and_loses_nothing():
    interval, events = 0.05, 100

    async def body_items(batch_interval_s: float) -> tuple[list[bytes], float]:
        app = make_app([], period_s=0.002, count=events)
        start = asyncio.get_running_loop().time()
        items = [
            item
            async for item in call_asgi(app, forwarded("/stream"), EXTRA, batch_interval_s)
            if isinstance(item, bytes)
        ]
        return items, asyncio.get_running_loop().time() - start

    want = "".join(f"data: {i}\n\n" for i in range(events)).encode()
    items, elapsed = asyncio.run(body_items(interval))
    assert b"".join(items) == want
    assert items[:2] == [b"data: 0\n\n", b"data: 1\n\n"]  # the head is not held back
    # After the burst of two, one item per interval on average; the last may follow at once.
    assert len(items) <= PACER_BURST + 1 + elapsed / interval, (len(items), elapsed)
    unbatched, _ = asyncio.run(body_items(0.0))
    assert b"".join(unbatched) == want and len(unbatched) > len(items)
