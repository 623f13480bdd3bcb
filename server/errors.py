"""OpenAI-shaped API errors: every failure a client can cause becomes one of these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from octavo.server.protocol import ErrorBody, ErrorResponse

# OpenAI's error type of a status; any other (400, 413, ...) is an invalid_request_error.
_ERROR_TYPES = {
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "internal_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(
                message=self.message,
                type=_ERROR_TYPES.get(self.status, "invalid_request_error"),
                param=self.param,
                code=self.code,
            )
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """The 400 of a request the client got wrong, naming the offending field (`param`)."""
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def model_not_found(model: str) -> APIError:
    """What a request naming a model this server does not serve gets (OpenAI's 404)."""
    return APIError(
        HTTPStatus.NOT_FOUND,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
    )


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The 400 of a request body that failed validation (pydantic's `errors()`), naming the
    first offending field; malformed JSON says so."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return bad_request(f"Malformed JSON body: {first.get('msg')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A field refused by a model-level check names itself in the error's context.
    ctx = first.get("ctx")
    param = loc[0] if loc else (ctx.get("field") if isinstance(ctx, dict) else None)
    message = f"{'.'.join(loc) or param or 'body'}: {first.get('msg')}"
    return bad_request(message, param)


def internal_error(exc: Exception) -> APIError:
    """The 500 of an exception no handler expected (a server bug)."""
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}")
