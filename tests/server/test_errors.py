"""Every client mistake gets an OpenAI-shaped 4xx (never a 500) and leaks nothing."""

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, live_server

GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


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
def test_invalid_parameters_are_400_naming_the_parameter(server, change, param):
    body = {k: v for k, v in (GOOD | change).items() if v is not None}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert_error(response, 400, param)


def test_malformed_json_and_wrong_types_are_400(server):
    url = f"{server.base_url}/v1/completions"
    assert_error(
        httpx.post(
            url, content=b"{not json", timeout=30, headers={"content-type": "application/json"}
        ),
        400,
    )
    assert_error(
        httpx.post(
            url, content=b"[1, 2]", timeout=30, headers={"content-type": "application/json"}
        ),
        400,
    )


def test_unknown_model_is_404(server):
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=GOOD | {"model": "gpt-4"}, timeout=30
    )
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found"


def test_unknown_route_is_an_openai_shaped_404(server):
    assert_error(httpx.get(f"{server.base_url}/v1/nothing", timeout=30), 404)


def test_oversized_body_is_413(server):
    body = b'{"model": "tiny", "prompt": "' + b"a" * (5 << 20) + b'"}'
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        content=body,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert_error(response, 413)


def test_errors_leave_the_server_idle_and_serving(server):
    for _ in range(3):
        httpx.post(f"{server.base_url}/v1/completions", json=GOOD | {"top_p": 9}, timeout=30)
    ok = httpx.post(f"{server.base_url}/v1/completions", json=GOOD, timeout=30)
    assert ok.status_code == 200
    metrics = server.metrics()
    assert metrics["octavo:num_requests_running"] == 0
    assert metrics["octavo:num_requests_waiting"] == 0


def test_the_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", temperature=-2)
    assert info.value.body["param"] == "temperature"


def test_api_key_is_required_when_set(tiny_model_dir, tmp_path):
    with live_server(tiny_model_dir, tmp_path, "--api-key", "sekrit") as secured:
        url = f"{secured.base_url}/v1/completions"
        assert_error(httpx.post(url, json=GOOD, timeout=30), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(httpx.post(url, json=GOOD, headers=wrong, timeout=30), 401)
        assert_error(httpx.get(f"{secured.base_url}/v1/models", timeout=30), 401)
        good = {"Authorization": "Bearer sekrit"}
        assert httpx.post(url, json=GOOD, headers=good, timeout=30).status_code == 200
        assert httpx.get(f"{secured.base_url}/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="sekrit", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
