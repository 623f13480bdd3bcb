"""GenerationRoutes: the generating routes' requests answered ahead of FastAPI's router, with
the errors the app's exception handlers give (an app of its own, no engine)."""

from http import HTTPStatus

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response

from octavo.server.errors import APIError
from octavo.server.generation_routes import GenerationRoute, add_generation_routes
from tests.server.openai_errors import assert_error


class Echo(BaseModel):
    word: str
    times: int = Field(1, ge=1)


async def echo(body: Echo, request: Request) -> Response:
    if body.word == "fail":
        raise RuntimeError("a bug in the handler")
    if body.word == "refuse":
        raise APIError(HTTPStatus.NOT_FOUND, "no such word", param="word")
    return JSONResponse({"echo": body.word * body.times, "path": request.url.path})


def authorize(request: Request) -> None:
    if request.headers.get("authorization") != "Bearer key":
        raise APIError(HTTPStatus.UNAUTHORIZED, "Invalid or missing API key")


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    add_generation_routes(app, [GenerationRoute("/echo", "echo", echo)], authorize)

    @app.get("/other")
    async def other() -> dict:
        return {"other": True}

    return TestClient(app, raise_server_exceptions=False, headers={"authorization": "Bearer key"})


def test_a_valid_body_reaches_the_handler_validated(client):
    response = client.post("/echo", json={"word": "ab", "times": 3})
    assert response.status_code == 200
    assert response.json() == {"echo": "ababab", "path": "/echo"}


def test_a_trailing_slash_names_the_same_route(client):
    assert client.post("/echo/", json={"word": "ab"}).json() == {"echo": "ab", "path": "/echo/"}


def test_other_paths_reach_the_app(client):
    assert client.get("/other").json() == {"other": True}


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"word": "ab", "times": 0}', "times"),
        (b'{"times": 2}', "word"),
        (b'{"word": "ab", "times": NaN}', "times"),  # parsed as FastAPI parses: a float
        (b'{"word": "ab"', None),
        (b"\xff\xfe\xfa", None),
        (b"[1, 2]", None),
        (b"[" * 100_000 + b"]" * 100_000, None),  # deeper than json can recurse
    ],
)
def test_a_bad_body_is_an_openai_shaped_400(client, content, param):
    response = client.post("/echo", content=content, headers={"content-type": "application/json"})
    error = assert_error(response, 400, param)
    if param is None and content.startswith(b"{"):
        assert error["message"].startswith("Malformed JSON body")


@pytest.mark.parametrize(
    ("content_type", "accepted"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
        (None, False),
        ("text/plain", False),  # what a page on another origin may send without asking
        ("application/x-www-form-urlencoded", False),
        ("application/jsonp", False),
    ],
)
def test_only_a_json_content_type_is_parsed(client, content_type, accepted):
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post("/echo", content=b'{"word": "ab"}', headers=headers)
    if accepted:
        assert response.json()["echo"] == "ab"
    else:
        error = assert_error(response, 400)
        assert "Content-Type" in error["message"]


def test_the_handlers_api_error_is_its_response(client):
    assert_error(client.post("/echo", json={"word": "refuse"}), 404, "word")


def test_an_unexpected_error_is_an_openai_shaped_500_and_the_app_serves_on(client):
    error = assert_error(client.post("/echo", json={"word": "fail"}), 500)
    assert "a bug in the handler" in error["message"]
    assert client.post("/echo", json={"word": "ok"}).status_code == 200


def test_an_unauthorized_request_is_refused_before_its_body_is_read(client):
    response = client.post("/echo", content=b"{not json", headers={"authorization": "Bearer x"})
    assert_error(response, 401)


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_other_methods_are_405_saying_post_is_allowed(client, method):
    response = client.request(method, "/echo")
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"


def test_the_route_is_documented_with_its_body_schema(client):
    operation = client.get("/openapi.json").json()["paths"]["/echo"]["post"]
    assert operation["operationId"] == "echo_echo_post"
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/Echo"}
