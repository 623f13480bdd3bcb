"""Every client mistake gets an OpenAI-shaped 4xx (never a 500) and leaks nothing (the app
in-process)."""

import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer
from tests.server.openai_errors import assert_error

GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 300}, "max_tokens"),  # prompt + max_tokens > context
        ({"prompt": "x " * 400}, "prompt"),  # longer than the context
        ({"prompt": [1, 2, 10_000]}, "prompt"),  # outside the vocabulary
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"logprobs": 99}, "logprobs"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"min_p": -0.5}, "min_p"),
        ({"stop_token_ids": [10_000]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"use_beam_search": True, "early_stopping": "maybe"}, "early_stopping"),
        ({"best_of": 3, "n": 4}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"model": None}, "model"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(http, change, param):
    body = {k: v for k, v in (GOOD | change).items() if v is not None}
    response = http.post("/v1/completions", json=body)
    assert_error(response, 400, param)


def test_malformed_json_and_wrong_types_are_400(http):
    headers = {"content-type": "application/json"}
    for content in (b"{not json", b"[1, 2]"):
        assert_error(http.post("/v1/completions", content=content, headers=headers), 400)


def test_unknown_model_is_404(http):
    response = http.post("/v1/completions", json=GOOD | {"model": "gpt-4"})
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found"


def test_unknown_route_is_an_openai_shaped_404(http):
    assert_error(http.get("/v1/nothing"), 404)


def test_oversized_body_is_413(http):
    body = b'{"model": "tiny", "prompt": "' + b"a" * (5 << 20) + b'"}'
    response = http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_error(response, 413)


def test_errors_leave_the_server_idle_and_serving(app_server, http):
    for _ in range(3):
        http.post("/v1/completions", json=GOOD | {"top_p": 9})
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200
    metrics = app_server.metrics()
    assert metrics["octavo:num_requests_running"] == 0
    assert metrics["octavo:num_requests_waiting"] == 0


def test_the_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", temperature=-2)
    assert info.value.body["param"] == "temperature"


def test_api_key_is_required_when_set(tiny_model_dir):
    secured = InProcessServer(tiny_model_dir, api_keys={"sekrit": "key0"})
    try:
        http = secured.http
        assert_error(http.post("/v1/completions", json=GOOD), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(http.post("/v1/completions", json=GOOD, headers=wrong), 401)
        assert_error(http.get("/v1/models"), 401)
        good = {"Authorization": "Bearer sekrit"}
        assert http.post("/v1/completions", json=GOOD, headers=good).status_code == 200
        assert http.get("/health").status_code == 200
        client = secured.openai(api_key="sekrit")
        assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
    finally:
        secured.close()
