"""The generating routes (completions, chat completions), answered by a middleware ahead of
FastAPI's router. server/app.py lists them (path, name, request model, handler) beside its
FastAPI routes; this module answers them.

Through FastAPI, every request of these routes would pass its exception middleware, its
exit-stack middleware, the router's match against every route, the route's own exception
wrapper and dependency solving before its handler ran: more than the handler itself costs
on a short request (the served figure that keeps this middleware: docs/benchmarks/history.md,
"The generating routes skip FastAPI's request handling"). Here the body is parsed and
validated as FastAPI does it (`json`, then the request model) and handed straight to the
route's handler; errors take the OpenAI shapes that the app's exception handlers give the
other routes. The guards in front of the app (Host check, body size limit) still apply:
this middleware sits inside them. FastAPI still documents the routes
(`GenerationRoute.openapi_route`).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from octavo.server.errors import APIError, internal_error, invalid_body

logger = logging.getLogger(__name__)

Handler = Callable[[Any, Request], Awaitable[Response]]


@dataclass(frozen=True)
class GenerationRoute:
    """A POST route whose JSON body is a `request_model`, answered by `handler(body,
    request)`. `name` and `responses` are its OpenAPI operation's."""

    path: str
    name: str
    request_model: type[BaseModel]
    handler: Handler
    responses: dict[int | str, dict[str, Any]] = field(default_factory=dict)

    def openapi_route(self) -> APIRoute:
        """The route as FastAPI documents it (the body's schema, the responses); never
        mounted, so never called: `GenerationRoutes` answers the path."""

        async def endpoint(request: Any) -> None:
            raise AssertionError("documentation only")

        body = inspect.Parameter(
            "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=self.request_model
        )
        endpoint.__signature__ = inspect.Signature([body])  # type: ignore[attr-defined]
        return APIRoute(
            self.path,
            endpoint,
            methods=["POST"],
            name=self.name,
            response_model=None,
            responses=self.responses,
        )


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
        self.routes = {route.path: route for route in routes}
        self.authorize = authorize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A trailing slash names the same route (FastAPI redirected it there).
        route = self.routes.get(scope["path"].rstrip("/")) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        response = await self._respond(route, Request(scope, receive))
        await response(scope, receive, send)

    async def _respond(self, route: GenerationRoute, request: Request) -> Response:
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
                raise APIError(HTTPStatus.BAD_REQUEST, "Content-Type must be application/json")
            try:
                # json, not pydantic's parser: it takes what FastAPI's does (NaN, lone
                # surrogates), which then fail validation naming their field.
                data = json.loads(await request.body())
            except ValueError as exc:  # not JSON, or not in a Unicode encoding
                raise APIError(HTTPStatus.BAD_REQUEST, f"Malformed JSON body: {exc}") from exc
            except RecursionError as exc:  # json recurses once per level of nesting
                raise APIError(HTTPStatus.BAD_REQUEST, "JSON body nested too deeply") from exc
            try:
                body = route.request_model.model_validate(data)
            except ValidationError as exc:
                raise invalid_body(exc.errors()) from exc
            return await route.handler(body, request)
        except APIError as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001 -- a server bug: this request's 500
            logger.exception("unhandled error")
            return internal_error(exc).response()
