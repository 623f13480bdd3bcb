"""The generating routes (completions, chat completions, responses), answered by a
middleware ahead of FastAPI's router. server/app.py lists them (path, name, handler) beside
its FastAPI routes; this module mounts them on FastAPI's router, which documents them, and
answers them first (`add_generation_routes`).

Through FastAPI, every request of these routes would pass its exception middleware, its
exit-stack middleware, the router's match against every route, the route's own exception
wrapper and dependency solving before its handler ran: more than the handler itself costs
on a short request (the served figure that keeps this middleware: docs/benchmarks/history.md,
"The generating routes skip FastAPI's request handling"). Here the body is parsed and
validated as FastAPI does it (`json`, then the request model) and handed straight to the
route's handler; errors take the OpenAI shapes that the app's exception handlers give the
other routes. The guards in front of the app (Host check, body size limit) still apply:
this middleware sits inside them. The routes are mounted on FastAPI's router as well, with
the same handlers: FastAPI documents them from the handlers' signatures, and never gets
their requests.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from octavo.server.errors import APIError, bad_request, internal_error, invalid_body

logger = logging.getLogger(__name__)

Handler = Callable[[Any, Request], Awaitable[Response]]


@dataclass(frozen=True)
class GenerationRoute:
    """A POST route answered by `handler(body, request)`, whose first parameter's annotation
    is the model of the JSON body (as FastAPI reads it). `name` and `responses` are its
    OpenAPI operation's; FastAPI would take a docstring of the handler for its description,
    so the handlers have none."""

    path: str
    name: str
    handler: Handler
    responses: dict[int | str, dict[str, Any]] = field(default_factory=dict)

    def request_model(self) -> type[BaseModel]:
        body = next(iter(inspect.signature(self.handler, eval_str=True).parameters.values()))
        return body.annotation


def add_generation_routes(
    app: FastAPI, routes: Sequence[GenerationRoute], authorize: Callable[[Request], None]
) -> None:
    """Mounts `routes` on the app's router, which documents them, and the middleware that
    answers their requests ahead of it (`GenerationRoutes`)."""
    for route in routes:
        app.add_api_route(
            route.path,
            route.handler,
            methods=["POST"],
            name=route.name,
            response_model=None,
            responses=route.responses,
        )
    app.add_middleware(GenerationRoutes, routes=routes, authorize=authorize)


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header names JSON: application/json or application/*+json,
    parameters (charset) aside."""
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


class GenerationRoutes:
    """ASGI middleware: answers every request to a `GenerationRoute`'s path, with or without
    a trailing slash (a method other than POST: 405), and passes every other request to the
    app.

    `authorize(request)` raises the APIError of a request that may not generate (the API
    key). A body that is not JSON by its Content-Type is refused, as FastAPI refuses it. An
    APIError raised before the response starts is its response; a body that fails
    validation is a 400 naming the field; any other exception is logged and a 500.
    """

    def __init__(
        self,
        app: ASGIApp,
        routes: Sequence[GenerationRoute],
        authorize: Callable[[Request], None],
    ):
        self.app = app
        self.routes = {route.path: (route.request_model(), route.handler) for route in routes}
        self.authorize = authorize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A trailing slash names the same route (FastAPI redirected it there).
        route = self.routes.get(scope["path"].rstrip("/")) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        response = await self._respond(*route, Request(scope, receive))
        await response(scope, receive, send)

    async def _respond(
        self, request_model: type[BaseModel], handler: Handler, request: Request
    ) -> Response:
        try:
            if request.method != "POST":
                raise APIError(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    HTTPStatus.METHOD_NOT_ALLOWED.phrase,
                    headers={"Allow": "POST"},
                )
            self.authorize(request)
            if not is_json(request.headers.get("content-type", "")):
                # As FastAPI refuses it: a browser sends other types across origins without
                # asking first (a "simple" request), JSON only after a CORS preflight.
                raise bad_request("Content-Type must be application/json")
            try:
                # json, not pydantic's parser: it takes what FastAPI's does (NaN, lone
                # surrogates), which then fail validation naming their field.
                data = json.loads(await request.body())
            except ValueError as exc:  # not JSON, or not in a Unicode encoding
                raise bad_request(f"Malformed JSON body: {exc}") from exc
            except RecursionError as exc:  # json recurses once per level of nesting
                raise bad_request("JSON body nested too deeply") from exc
            try:
                body = request_model.model_validate(data)
            except ValidationError as exc:
                raise invalid_body(exc.errors()) from exc
            return await handler(body, request)
        except APIError as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001 -- a server bug: this request's 500
            logger.exception("unhandled error")
            return internal_error(exc).response()
