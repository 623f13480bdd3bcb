"""vLLM's `priority` request field and the fair policy's `user` over HTTP (the app in-process):
taken on completions, chat and responses where the policy reads it, a clear 400 naming
`priority` where it does not or where the value is bad, and nothing left queued either way."""

import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer
from tests.server.openai_errors import assert_error

ROUTES = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3},
    "/v1/chat/completions": {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 3,
    },
    "/v1/responses": {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 3},
}


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir):
    server = InProcessServer(tiny_model_dir, {"scheduling_policy": "priority"})
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def fair_server(tiny_model_dir):
    server = InProcessServer(tiny_model_dir, {"scheduling_policy": "fair", "max_num_seqs": 2})
    try:
        yield server
    finally:
        server.close()


def assert_idle(server: InProcessServer) -> None:
    metrics = server.metrics()
    assert metrics["octavo:num_requests_running"] == 0
    assert metrics["octavo:num_requests_waiting"] == 0


@pytest.mark.parametrize("route", ROUTES)
def test_priority_under_fcfs_is_a_400_naming_it(app_server, route):
    body = ROUTES[route]
    error = assert_error(app_server.http.post(route, json=body | {"priority": 2}), 400, "priority")
    assert "--scheduling-policy priority" in error["message"]
    assert app_server.http.post(route, json=body | {"priority": 0}).status_code == 200
    assert_idle(app_server)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("priority", [True, "1", 1.5, 2**63, -(2**63) - 1, [1]])
def test_a_bad_priority_is_a_400_naming_it(priority_server, route, priority):
    response = priority_server.http.post(route, json=ROUTES[route] | {"priority": priority})
    assert_error(response, 400, "priority")


@pytest.mark.parametrize("route", ROUTES)
def test_the_priority_policy_takes_priorities_on_every_route(priority_server, route):
    for priority in (-5, 0, 7.0):  # an integral float is an integer, as JSON Schema says
        response = priority_server.http.post(route, json=ROUTES[route] | {"priority": priority})
        assert response.status_code == 200, response.text
    assert_idle(priority_server)


def test_the_openai_client_sends_priority_as_an_extra_field(priority_server):
    client = priority_server.openai()
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=3, extra_body={"priority": -1}
    )
    assert completion.choices[0].finish_reason == "length"


def test_the_fair_policy_serves_every_user_and_anonymous_requests(fair_server):
    client = fair_server.openai()
    for user in ("alice", "bob", None):
        extra = {} if user is None else {"user": user}
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, **extra
        )
        assert chat.choices[0].message.content is not None
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=4, n=2, stream=True, user="carol"
    )
    assert sum(1 for _ in stream) >= 2
    assert_idle(fair_server)


def test_with_several_keys_the_fair_policy_serves_each_key_as_its_user(tiny_model_dir):
    server = InProcessServer(
        tiny_model_dir, {"scheduling_policy": "fair"}, api_keys={"ka": "alice", "kb": "bob"}
    )
    try:
        body = ROUTES["/v1/completions"] | {"user": "mallory"}  # the key decides, not this
        for key in ("ka", "kb"):
            headers = {"Authorization": f"Bearer {key}"}
            response = server.http.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
        wrong = server.http.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer kc"}
        )
        assert_error(wrong, 401)
        counters = server.engine.client.core.scheduler.waiting.counters
        assert set(counters) == {"alice", "bob"}
        assert_idle(server)
    finally:
        server.close()
