"""Client disconnects free their blocks; 100 concurrent streams; a burst beyond the queue."""

import asyncio
import json
import random
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, live_server

pytestmark = pytest.mark.slow

LONG = {
    "model": MODEL_NAME,
    "prompt": "The class",
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
MID_STREAM_ATTEMPTS = 10


def wait_for_idle(server, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = (
            metrics["octavo:num_requests_running"] == 0
            and metrics["octavo:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def running_mid_stream(server, response) -> dict[str, float] | None:
    """Reads `response`'s events until /metrics shows its request running (its metrics then),
    or to the stream's end (None: the engine, which does not wait for readers, finished it
    before the client saw it run; its first event may come before it is scheduled)."""
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        metrics = server.metrics()
        if metrics["octavo:num_requests_running"] == 1:
            return metrics
    return None


def test_a_client_that_disconnects_mid_stream_frees_everything(server):
    """The disconnect aborts the request: it stops short of its max_tokens (near the most the
    test model's 256 positions allow after the prompt) and its blocks are free at once."""
    body = LONG | {"max_tokens": 250}
    for _ in range(MID_STREAM_ATTEMPTS):
        generated = server.metrics()["octavo:generation_tokens_total"]
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
        ) as response:
            busy = running_mid_stream(server, response)
            if busy is None:
                continue  # no disconnect to test in this attempt
            assert busy["octavo:kv_cache_usage_perc"] > 0
        break
    else:
        raise AssertionError(f"no stream was seen running in {MID_STREAM_ATTEMPTS} attempts")
    closed = time.monotonic()
    metrics = wait_for_idle(server, timeout=2.0)
    assert metrics["octavo:num_requests_running"] == 0, metrics
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
    assert time.monotonic() - closed < 2.0
    assert metrics["octavo:generation_tokens_total"] - generated < body["max_tokens"]


def test_a_client_that_leaves_before_its_plain_response_frees_everything(server):
    """A non-streaming request is aborted when its client leaves: it does not run to
    max_tokens for nobody."""
    generated = server.metrics()["octavo:generation_tokens_total"]
    body = json.dumps(LONG | {"stream": False, "max_tokens": 240}).encode()
    url = urlsplit(server.base_url)
    with socket.create_connection((url.hostname, url.port)) as client:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        client.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while server.metrics()["octavo:num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
    metrics = wait_for_idle(server, timeout=2.0)
    assert metrics["octavo:num_requests_running"] == 0, metrics
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
    assert metrics["octavo:generation_tokens_total"] - generated < 240


async def stream_one(client: httpx.AsyncClient, base_url: str, body: dict) -> dict:
    """Streams one completion; returns its status, text and finish reasons (or error)."""
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {
                "status": response.status_code,
                "body": json.loads(await response.aread()),
                "headers": response.headers,
            }
        text, finish, done = "", {}, False
        async for line in response.aiter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                continue
            choice = json.loads(payload)["choices"][0]
            text += choice["text"]
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
        return {"status": 200, "text": text, "finish": finish, "done": done}


async def run_many(base_url: str, bodies: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, base_url, b) for b in bodies))


def test_one_hundred_concurrent_streams_all_complete(server):
    bodies = [
        {
            "model": MODEL_NAME,
            "prompt": f"Item {i} of the list",
            "max_tokens": 8 + i % 9,
            "temperature": 0.8,
            "seed": i,
            "stream": True,
            **({"ignore_eos": True} if i % 2 else {"stop": ["\n\n"]}),
        }
        for i in range(100)
    ]
    results = asyncio.run(run_many(server.base_url, bodies))
    assert all(r["status"] == 200 and r["done"] for r in results)
    for body, result in zip(bodies, results, strict=True):
        assert set(result["finish"]) == {0}
        if body.get("ignore_eos"):
            assert result["finish"][0] == "length"
        else:
            assert result["finish"][0] in {"stop", "length"}
    assert wait_for_idle(server, timeout=2.0)["octavo:kv_cache_usage_perc"] == 0


def test_a_burst_beyond_the_waiting_queue_gets_503_and_the_rest_completes(tiny_model_dir, tmp_path):
    with live_server(
        tiny_model_dir, tmp_path, "--max-num-seqs", "2", "--max-num-waiting", "4"
    ) as small:
        body = LONG | {"max_tokens": 40}
        results = asyncio.run(run_many(small.base_url, [body] * 20))
        statuses = [r["status"] for r in results]
        accepted = [r for r in results if r["status"] == 200]
        rejected = [r for r in results if r["status"] == 503]
        assert len(accepted) + len(rejected) == 20, statuses
        # At least a full waiting queue is accepted (more as running ones get admitted).
        assert len(accepted) >= 4 and rejected
        assert all(r["done"] and r["finish"] == {0: "length"} for r in accepted)
        for r in rejected:
            assert r["headers"]["retry-after"] == "1"
            error = r["body"]["error"]
            assert error["type"] == "service_unavailable_error" and "waiting" in error["message"]
        assert wait_for_idle(small, timeout=2.0)["octavo:kv_cache_usage_perc"] == 0


async def maybe_cut(client: httpx.AsyncClient, base_url: str, body: dict, cut_after: float | None):
    """One request, streamed or plain; the client leaves after `cut_after` seconds if set."""
    try:
        async with asyncio.timeout(cut_after):
            if body["stream"]:
                async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                await client.post(f"{base_url}/v1/completions", json=body)
    except TimeoutError:
        pass


def test_a_storm_of_clients_leaving_at_random_frees_everything(server):
    """Half of 120 clients leave at random moments (queued, prefilling, decoding, before a
    plain response, mid-stream), with n and best_of > 1 among them: nothing is left running,
    every block is free, and the server serves on. (That a request stops when its client
    leaves is shown one request at a time above: here a client may leave before its request
    reached the engine, so the tokens made cannot show it.)"""
    rng = random.Random(11)
    bodies = []
    for i in range(120):
        stream = rng.random() < 0.6
        n = rng.choice([1, 1, 2, 3])
        bodies.append({
            "model": MODEL_NAME, "prompt": f"Item {i}", "max_tokens": rng.choice([4, 40, 120]),
            "temperature": rng.choice([0.0, 1.0]), "seed": i, "n": n, "stream": stream,
            "ignore_eos": True, **({} if stream or rng.random() < 0.5 else {"best_of": n + 1}),
        })  # fmt: skip
    cuts = [rng.uniform(0.01, 0.4) if rng.random() < 0.5 else None for _ in bodies]

    async def storm() -> None:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(
                *(
                    maybe_cut(client, server.base_url, b, c)
                    for b, c in zip(bodies, cuts, strict=True)
                )
            )

    asyncio.run(storm())
    metrics = wait_for_idle(server, timeout=10.0)
    assert metrics["octavo:num_requests_running"] == 0, metrics
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
