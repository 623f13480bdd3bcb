"""Guards in front of the app: the Host allow list, the body size limit, and a deadline for
a connection's request headers (uvicorn has none)."""

from __future__ import annotations

import asyncio
import hmac
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from octavo.server.errors import APIError

# Hosts a server bound to a loopback address answers by default: a page on another origin
# that resolves its own name to 127.0.0.1 (DNS rebinding) sends its own name as the Host.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(host_header: str) -> str:
    """The host of a Host header, without port or IPv6 brackets, lower-cased."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostCheck:
    """Answers an OpenAI-shaped 400 to requests whose Host is not in `allowed_hosts` ("*"
    allows any). /health is exempt: it discloses nothing, and probes (Docker, Kubernetes)
    address the server by whatever name or IP they have."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]):
        self.app = app
        self.allowed = {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        checked = scope["type"] == "http" and scope.get("path") != "/health"
        if checked and "*" not in self.allowed:
            host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed:
                error = APIError(HTTPStatus.BAD_REQUEST, "Invalid Host header", code="invalid_host")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_api_key(authorization: str, api_keys: dict[str, str]) -> str:
    """The user of the key `authorization` (the header) carries as `Bearer <key>`, the
    scheme case-insensitive (RFC 9110), each key compared in constant time; the 401 when it
    is none of `api_keys`."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    user = None
    for key, name in api_keys.items():  # every key compared: the time tells nothing
        if hmac.compare_digest(given, key.encode()):
            user = name
    if scheme.lower() != "bearer" or user is None:
        raise APIError(
            HTTPStatus.UNAUTHORIZED, "Invalid or missing API key", code="invalid_api_key"
        )
    return user


def body_too_large(max_bytes: int) -> APIError:
    """The 413 of a request body over `max_bytes`."""
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"Request body exceeds {max_bytes} bytes")


class BodySizeLimit:
    """Answers 413 for request bodies over `max_bytes`, by Content-Length or while reading.

    The body is read here, in full, before the app sees the request: a chunked body that
    grows past the limit gets its 413 before any handler starts (a handler that ran into it
    mid-parse would answer 400). Bodies are small (a few MiB at most), so buffering is cheap.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = body_too_large(self.max_bytes)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large.response()(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: http.disconnect, when it comes

        await self.app(scope, replay, send)


def http_with_header_timeout(header_timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (the C parser: less CPU per request and per streamed
    event than h11's, docs/benchmarks/history.md) with a deadline for each request's headers: a
    connection that has sent no complete request `header_timeout` seconds after it opened (or
    after its last response) is closed, so idle half-open connections cannot pile up
    (slowloris)."""

    class HttpToolsWithHeaderTimeout(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_deadline: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_request():
                self._arm()
            elif self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            super().connection_lost(exc)

        def _awaiting_request(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            self._header_deadline = None
            if self._awaiting_request() and not self.transport.is_closing():
                self.transport.close()

    return HttpToolsWithHeaderTimeout
