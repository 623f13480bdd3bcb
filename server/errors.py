"""OpenAI-shaped API errors: every failure a client can cause becomes one of these."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from fastapi.responses import JSONResponse

from octavo.server.protocol import ErrorBody, ErrorResponse

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
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


def model_not_found(model: str) -> APIError:
    """What a request naming a model this server does not serve gets (OpenAI's 404)."""
    return APIError(
        HTTPStatus.NOT_FOUND,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
    )
