"""The FastAPI application factory: routes, auth, body limit and OpenAI-shaped errors.

Every route is named in `create_app`: FastAPI's decorated ones, then the generating ones
(/v1/completions, /v1/chat/completions, /v1/responses), which a middleware answers ahead of
FastAPI's router (generation_routes.py).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.server.chat_protocol import ChatCompletionResponse
from octavo.server.errors import APIError, internal_error, invalid_body, model_not_found
from octavo.server.generation_routes import GenerationRoute, add_generation_routes
from octavo.server.http_guards import BodySizeLimit, HostCheck, check_api_key
from octavo.server.metrics import ServerMetrics
from octavo.server.protocol import (
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from octavo.server.responses_protocol import ResponsesResponse
from octavo.server.serving_chat import ChatServing
from octavo.server.serving_completion import CompletionServing
from octavo.server.serving_engine import ServerConfig
from octavo.server.serving_responses import ResponsesServing
from octavo.server.serving_tokenization import TokenizationServing

logger = logging.getLogger(__name__)


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """Builds the app around a (not yet started) AsyncEngine; the app's lifespan starts the
    engine thread and shuts it down gracefully."""
    lora_names = config.lora.names if config.lora is not None else dict
    metrics = ServerMetrics(engine, config.metrics_dir, lora_names)
    serving = CompletionServing(engine, config, metrics)
    chat = ChatServing(engine, config, metrics)
    responses = ResponsesServing(engine, config, metrics)
    tokenization = TokenizationServing(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        await engine.shutdown(config.shutdown_grace_seconds)

    def authorize(request: Request) -> None:
        """The 401 of a request without an accepted key; else the key's user, kept in the
        request's state (`api_user`) for the generating routes."""
        if config.api_keys is not None:
            authorization = request.headers.get("authorization", "")
            request.state.api_user = check_api_key(authorization, config.api_keys)

    async def require_api_key(request: Request) -> None:
        authorize(request)

    app = FastAPI(title="Octavo", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_body(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keeps the exception's headers: a 405 must say which methods are Allowed.
        status = HTTPStatus(exc.status_code)
        return APIError(status, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def unhandled_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return internal_error(exc).response()

    @app.get("/health", response_class=Response, responses=_HEALTH_RESPONSES)
    async def health() -> Response:
        status = HTTPStatus.OK if engine.accepting else HTTPStatus.SERVICE_UNAVAILABLE
        return Response(status_code=status)

    @app.get("/metrics", response_class=Response, responses=_METRICS_RESPONSES)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # The routes behind --api-key (the generating ones check it in their middleware).
    keyed = APIRouter(dependencies=[Depends(require_api_key)])

    @keyed.get("/v1/models", responses=_errors(400, 401))
    async def models() -> ModelList:
        return ModelList(data=tokenization.model_cards())

    @keyed.get("/v1/models/{model_id:path}", responses=_errors(400, 401, 404))
    async def model(model_id: str) -> ModelCard:
        for card in tokenization.model_cards():
            if card.id == model_id:
                return card
        raise model_not_found(model_id)

    if config.lora is not None and config.allow_runtime_lora_updating:
        lora = config.lora

        @keyed.post("/v1/load_lora_adapter", responses=_errors(400, 401))
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            # Reading the adapter's files off the loop: a slow disk stalls no stream.
            await asyncio.to_thread(lora.add, request.lora_name, request.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added.")

        @keyed.post("/v1/unload_lora_adapter", responses=_errors(400, 401, 404))
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            lora.remove(request.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed.")

    @keyed.post("/tokenize", responses=_errors(400, 401, 404))
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return tokenization.tokenize(request)

    @keyed.post("/detokenize", responses=_errors(400, 401, 404))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.detokenize(request)

    app.include_router(keyed)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=importlib.metadata.version("octavo"))

    # The generating routes, POST only. A middleware ahead of FastAPI's router answers them:
    # generation_routes.py says why.
    chunks = "one `data: <{} JSON>` per chunk, then `data: [DONE]`.".format
    generation_routes = (
        GenerationRoute(
            "/v1/completions",
            "completions",
            serving.create_completion,
            _generating(CompletionResponse, "completion", chunks("CompletionResponse")),
        ),
        GenerationRoute(
            "/v1/chat/completions",
            "chat_completions",
            chat.create_chat_completion,
            _generating(ChatCompletionResponse, "chat completion", chunks("ChatCompletionChunk")),
        ),
        GenerationRoute(
            "/v1/responses",
            "create_response",
            responses.create_responses,
            _generating(
                ResponsesResponse,
                "response",
                "per event `event: <type>` and `data: <event JSON>`, from response.created to "
                "response.completed (response.incomplete at max_output_tokens); no [DONE].",
            ),
        ),
    )

    # Middleware added last runs first: the Host check, then the body limit, then the
    # generating routes, then FastAPI's router for the rest.
    add_generation_routes(app, generation_routes, authorize)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    if config.allowed_hosts is not None:  # a foreign Host gets nothing else
        app.add_middleware(HostCheck, allowed_hosts=config.allowed_hosts)

    def openapi() -> dict[str, Any]:
        """FastAPI's document without the 422 it adds to every route with a body: this
        server answers validation errors with 400 (OpenAI's shape)."""
        schema = app.openapi_schema
        if schema is None:
            schema = FastAPI.openapi(app)  # which keeps it as app.openapi_schema
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
    return app


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error statuses, each with the OpenAI-shaped error body."""
    return {
        status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase}
        for status in statuses
    }


def _generating(model: type[BaseModel], answer: str, events: str) -> dict[int | str, Any]:
    """The OpenAPI responses of a generating route: the `answer` (a `model`), or with stream
    the SSE `events`; a 204 to a client that left first; the errors."""
    return {
        200: {
            "model": model,
            "description": f"The {answer}, or with `stream: true` server-sent events: {events}",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        204: {"description": f"The client disconnected before the {answer.split()[-1]} was ready."},
    } | _errors(400, 401, 404, 413, 429, 500, 503)


_HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Serving.", "content": {}},
    503: {"description": "Shutting down, or the engine stopped.", "content": {}},
}
_METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format.",
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
    },
}
