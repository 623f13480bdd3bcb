"""The two Ray Serve deployments: `EngineReplica` (one Octavo server each: engine and app)
and `Ingress` (the HTTP entry: reads a request, forwards it to a replica chosen by the
request router, streams the replica's response back).

Every route, check, error and SSE stream is the replica's own `octavo serve` app, run
in-process through `call_asgi`, so a request answers the same through Ray as without it.
The ingress adds what only it can know: a body size bound before forwarding, the routing
key, and a 503 (or, mid-stream, an SSE error event) when the replica serving a request
dies. A client that disconnects cancels the forwarded call; the replica's app then sees
`http.disconnect` and aborts the request in its engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from http import HTTPStatus

from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from octavo.server.errors import APIError
from octavo.server.http_guards import body_too_large
from octavo.server.launch import build_server
from octavo.server.ray_serve.asgi_bridge import call_asgi
from octavo.server.ray_serve.messages import (
    REPLICA_HEADER,
    ForwardedRequest,
    ReplicaStats,
    ResponseStart,
)
from octavo.server.ray_serve.replica_metrics import PUBLISH_PERIOD_S, ReplicaMetrics
from octavo.server.ray_serve.routing import routing_key
from octavo.server.server_args import ServerArgs
from octavo.server.streaming import SSE_DONE, EventEncoder

logger = logging.getLogger(__name__)


class EngineReplica:
    """One `octavo serve` (engine core process and app) inside a Ray Serve replica."""

    async def __init__(self, args: ServerArgs):  # type: ignore[misc]
        # Async: Ray Serve awaits it on the replica's event loop, which the engine joins.
        self._engine, self._app = build_server(args)
        self._engine.start()
        self._grace_seconds = args.shutdown_grace_seconds
        self._batch_interval_s = args.stream_batching_ms / 1000
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._headers = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        self._publishing = asyncio.ensure_future(
            ReplicaMetrics().publish_every(PUBLISH_PERIOD_S, self._engine.stats)
        )

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to `request`: its ResponseStart, then its body chunks."""
        async for item in call_asgi(self._app, request, self._headers, self._batch_interval_s):
            yield item

    def stats(self) -> ReplicaStats:
        """This replica's id and process, and its engine's stats after the latest step."""
        return ReplicaStats(self.replica_id, os.getpid(), self._engine.stats())

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose engine died (or stopped) is replaced."""
        if not self._engine.accepting:
            raise RuntimeError("the Octavo engine is not accepting requests")

    async def __del__(self) -> None:
        self._publishing.cancel()
        await self._engine.shutdown(self._grace_seconds)


class Ingress:
    """The HTTP entry point (Ray Serve's proxy calls it): forwards each request whole."""

    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int):
        self._replicas = replicas.options(stream=True)
        self._max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        try:
            body = await self._read_body(request)
        except APIError as exc:
            return exc.response()
        except ClientDisconnect:
            return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody reads it
        path = request.url.path
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]),
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
            routing_key=routing_key(path, body),
        )
        stream = self._replicas.handle.remote(forwarded)
        assert isinstance(stream, DeploymentResponseGenerator)  # a stream=True handle
        try:
            start = await stream.__anext__()
        except (RayError, StopAsyncIteration) as exc:
            stream.cancel()
            return _replica_failed(exc).response()
        assert isinstance(start, ResponseStart)
        response = StreamingResponse(_body(stream, _is_sse(start)), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response

    async def _read_body(self, request: Request) -> bytes:
        """The whole body, refused past `max_body_bytes` (as the replica itself would)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise body_too_large(self._max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self._max_body_bytes:
                raise body_too_large(self._max_body_bytes)
        return bytes(body)


async def _body(stream: DeploymentResponseGenerator, sse: bool) -> AsyncIterator[bytes]:
    """The replica's body chunks. If the replica dies mid-response, an SSE stream ends with
    an error event and [DONE], as `octavo serve` ends a stream whose engine failed; the
    forwarded call is cancelled whenever this generator stops early (a client disconnect)."""
    try:
        async for chunk in stream:
            yield chunk
    except RayError as exc:
        logger.warning("replica failed mid-response: %s", exc)
        if sse:
            yield EventEncoder().event(_replica_failed(exc).body())
            yield SSE_DONE
    finally:
        stream.cancel()


def _is_sse(start: ResponseStart) -> bool:
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in start.headers
    )


def _replica_failed(exc: BaseException) -> APIError:
    return APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"the replica serving this request failed ({type(exc).__name__}); retry it",
        code="replica_failed",
    )
