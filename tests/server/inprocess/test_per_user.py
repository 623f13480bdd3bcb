"""Per-user serving over HTTP (the app in-process): /metrics per user (each API key's user, or
the `user` field without keys) and --max-num-waiting-per-user's 429, with every other user
served on and nothing left queued or held."""

import asyncio
import re

import openai
import pytest

from octavo.engine.frontend.async_engine import AsyncEngine
from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import BASE_URL, InProcessServer
from tests.server.openai_errors import assert_error

BODY = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True}


def user_series(server: InProcessServer, name: str) -> dict[str, float]:
    """`octavo:{name}` per user label, from /metrics."""
    pattern = re.compile(rf'^octavo:{name}(?:_total)?{{user="([^"]*)"}} (\S+)$')
    series = {}
    for line in server.http.get("/metrics").text.splitlines():
        match = pattern.match(line)
        if match:
            series[match[1]] = float(match[2])
    return series


def assert_idle(server: InProcessServer) -> None:
    metrics = server.metrics()
    assert metrics["octavo:num_requests_running"] == 0
    assert metrics["octavo:num_requests_waiting"] == 0
    assert metrics["octavo:kv_cache_usage_perc"] == 0


def test_metrics_show_each_keys_user_and_its_tokens(tiny_model_dir):
    server = InProcessServer(tiny_model_dir, api_keys={"ka": "alice", "kb": "bob"})
    try:
        usage = {}
        for key, user, count in (("ka", "alice", 2), ("kb", "bob", 1)):
            headers = {"Authorization": f"Bearer {key}"}
            for _ in range(count):
                # The `user` field does not decide whom a keyed request is served for.
                body = BODY | {"user": "mallory"}
                response = server.http.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                served = response.json()["usage"]
                previous = usage.get(user, (0, 0))
                usage[user] = (
                    previous[0] + served["prompt_tokens"],
                    previous[1] + served["completion_tokens"],
                )
        assert user_series(server, "user_prompt_tokens") == {
            user: float(prompt) for user, (prompt, _) in usage.items()
        }
        assert user_series(server, "user_generation_tokens") == {
            user: float(generated) for user, (_, generated) in usage.items()
        }
        assert user_series(server, "user_requests_running") == {"alice": 0.0, "bob": 0.0}
        assert user_series(server, "user_requests_waiting") == {"alice": 0.0, "bob": 0.0}
        assert_idle(server)
    finally:
        server.close()


def test_metrics_label_requests_by_their_user_field_without_keys(tiny_model_dir):
    server = InProcessServer(tiny_model_dir)
    try:
        for user in ("carol", None):
            body = BODY if user is None else BODY | {"user": user}
            assert server.http.post("/v1/completions", json=body).status_code == 200
        generated = user_series(server, "user_generation_tokens")
        assert generated == {"carol": 5.0, "": 5.0}  # "": no user field
    finally:
        server.close()


async def burst(server: InProcessServer, bodies: list[tuple[str, dict]]) -> list:
    async def one(user: str, body: dict):
        return user, await server.client.post("/v1/completions", json=body | {"user": user})

    return await asyncio.gather(*(one(user, body) for user, body in bodies))


def test_a_user_past_its_waiting_limit_gets_429_and_others_are_served(tiny_model_dir):
    server = InProcessServer(tiny_model_dir, {"max_num_seqs": 2}, max_num_waiting_per_user=3)
    try:
        long = BODY | {"max_tokens": 40}
        bodies = [("flood", long)] * 20 + [("calm", long)] * 2
        results = server.run(burst(server, bodies))
        flood = [response for user, response in results if user == "flood"]
        calm = [response for user, response in results if user == "calm"]
        assert all(response.status_code == 200 for response in calm)  # 2 < its limit
        accepted = [r for r in flood if r.status_code == 200]
        rejected = [r for r in flood if r.status_code == 429]
        assert len(accepted) + len(rejected) == 20, [r.status_code for r in flood]
        assert len(accepted) >= 3 and rejected  # at least a full share waits
        for response in rejected:
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and "waiting" in error["message"]
        for response in accepted:
            assert response.json()["usage"]["completion_tokens"] == 40
        assert_idle(server)
        # Once its requests have run, the user is served again.
        assert server.http.post("/v1/completions", json=BODY | {"user": "flood"}).status_code == 200
    finally:
        server.close()


def test_more_prompts_than_a_users_share_is_a_400_naming_prompt(tiny_model_dir):
    server = InProcessServer(tiny_model_dir, max_num_waiting_per_user=2)
    try:
        body = BODY | {"prompt": ["a", "b", "c"]}
        error = assert_error(server.http.post("/v1/completions", json=body), 400, "prompt")
        assert "--max-num-waiting-per-user" in error["message"]
        ok = server.http.post("/v1/completions", json=BODY | {"prompt": ["a", "b"]})
        assert ok.status_code == 200, ok.text
        assert_idle(server)
    finally:
        server.close()


@pytest.mark.parametrize("value", [0, -1])
def test_the_engine_refuses_a_per_user_limit_below_one(value):
    # Checked before the engine reads anything of its core client.
    with pytest.raises(ValueError, match="max_num_waiting_per_user must be >= 1"):
        AsyncEngine(None, None, 8, max_num_waiting_per_user=value)  # type: ignore[arg-type]


def test_the_openai_client_reads_the_429_as_a_rate_limit(tiny_model_dir):
    server = InProcessServer(tiny_model_dir, {"max_num_seqs": 1}, max_num_waiting_per_user=1)
    try:
        client = openai.AsyncOpenAI(
            base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0, http_client=server.client
        )

        async def one():
            try:
                await client.completions.create(
                    model=MODEL_NAME, prompt="Hello", max_tokens=30, user="flood",
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                return "ok"
            except openai.RateLimitError as exc:
                assert exc.response.headers["retry-after"] == "1"
                return "limited"

        async def burst_of(count: int):
            return await asyncio.gather(*(one() for _ in range(count)))

        outcomes = server.run(burst_of(8))
        assert "ok" in outcomes and "limited" in outcomes, outcomes
        assert_idle(server)
    finally:
        server.close()
