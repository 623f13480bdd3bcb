"""`octavo serve --ray` on a local Ray instance: two engine replicas behind one endpoint.

The oracle for what comes back is the offline engine on the same model (greedy tokens) and
the official openai client; placement is read from each response's replica header, and
cache hits from `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from octavo.engine import LLM, SamplingParams
from octavo.engine.core_messages import EngineStats
from octavo.server.ray_serve.launch import APP_NAME, build_app
from octavo.server.ray_serve.messages import REPLICA_HEADER, ReplicaStats
from octavo.server.server_args import ServerArgs
from tests.server.conftest import CHAT_TEMPLATE, MODEL_NAME, core_pid, free_port

pytestmark = pytest.mark.slow

NUM_REPLICAS = 2
NUM_BLOCKS = 4096  # of 8 tokens: room for the 64 x 256 tokens of the disconnect test
# Logical CPUs for the local Ray instance: two replicas and the ingress reserve 2.5; the
# machine's 2 cores are shared by every process anyway.
RAY_CPUS = 4
RECOVERY_TIMEOUT_S = 120
STREAM_POLL_S = 0.01
SHARED_PREFIXES = 3
REQUESTS_PER_PREFIX = 6


@pytest.fixture(scope="module")
def ray_endpoint(tiny_model_dir):
    """The Ray Serve app of `octavo serve --ray --num-replicas 2 --routing prefix`."""
    port = free_port()
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = ServerArgs.from_config(
            {
                "model": tiny_model_dir,
                "served_model_name": MODEL_NAME,
                "device": "cpu",
                "dtype": "float32",  # as the offline oracle: tokens equal whatever the batch
                "num_blocks": NUM_BLOCKS,
                "block_size": 8,
                "chat_template": CHAT_TEMPLATE,
                "num_replicas": NUM_REPLICAS,
                "routing": "prefix",
                "num_cpus_per_replica": 1,
                "torch_threads": 1,
            }
        )
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_client(ray_endpoint):
    return openai.OpenAI(base_url=f"{ray_endpoint}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=8)


def greedy_text(offline: LLM, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def replicas() -> dict[str, ReplicaStats]:
    """Each live replica's stats by replica id (asked until every replica answered)."""
    handle = serve.get_deployment_handle("EngineReplica", APP_NAME)
    found: dict[str, ReplicaStats] = {}
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while len(found) < NUM_REPLICAS and time.monotonic() < deadline:
        stats = handle.stats.remote().result()
        found[stats.replica_id] = stats
    return found


def replica_stats() -> dict[str, EngineStats]:
    """Each live replica's engine stats by replica id."""
    return {replica_id: stats.engine for replica_id, stats in replicas().items()}


def test_completions_and_chat_through_ray_equal_the_engine(ray_client, offline):
    prompt = "def fibonacci(n):"
    want = greedy_text(offline, prompt, 12)
    params = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0}
    completion = ray_client.completions.create(
        prompt=prompt, **params, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == want
    assert completion.usage.completion_tokens == 12
    streamed = ray_client.completions.create(
        prompt=prompt, stream=True, **params, extra_body={"ignore_eos": True}
    )
    chunks = [c.choices[0].text for c in streamed if c.choices]
    assert len(chunks) > 1 and "".join(chunks) == want
    messages = [{"role": "user", "content": "Say something."}]
    rendered = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
    chat = ray_client.chat.completions.create(
        messages=messages, **params, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == greedy_text(offline, rendered, 12)


def test_errors_keep_the_servers_shape_through_ray(ray_endpoint, ray_client):
    with pytest.raises(openai.BadRequestError) as bad:
        ray_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        ray_client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    too_large = httpx.post(f"{ray_endpoint}/v1/completions", content=b"x" * (5 << 20), timeout=30)
    assert too_large.status_code == 413 and "error" in too_large.json()
    assert httpx.get(f"{ray_endpoint}/health", timeout=30).status_code == 200
    assert httpx.get(f"{ray_endpoint}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL_NAME


async def post_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_a_load_of_120_requests_has_no_failure_and_uses_both_replicas(ray_endpoint):
    bodies = [
        # ignore_eos: a sampled token may be the EOS, and every request must run 8 tokens
        {
            "model": MODEL_NAME,
            "prompt": f"request {i}: x = {i} *",
            "max_tokens": 8,
            "ignore_eos": True,
        }
        for i in range(120)
    ]
    responses = asyncio.run(post_all(ray_endpoint, bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies)
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    assert len({r.headers[REPLICA_HEADER] for r in responses}) == NUM_REPLICAS


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica_and_hits_its_cache(ray_endpoint):
    prefixes = [f"# module {p}\n" + "import os, sys\n" * 20 for p in range(SHARED_PREFIXES)]
    placed: dict[int, set[str]] = {p: set() for p in range(SHARED_PREFIXES)}
    cached = []
    for i in range(REQUESTS_PER_PREFIX):  # waves: a prefix is computed before it is reused
        bodies = [
            {"model": MODEL_NAME, "prompt": f"{prefix}def f{i}():", "max_tokens": 2}
            for prefix in prefixes
        ]
        for p, response in enumerate(asyncio.run(post_all(ray_endpoint, bodies))):
            assert response.status_code == 200
            placed[p].add(response.headers[REPLICA_HEADER])
            if i > 0:
                cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(replicas) == 1 for replicas in placed.values())
    assert all(c > 0 for c in cached)  # every later request found its prefix cached


def generated_tokens() -> int:
    return sum(s.num_generation_tokens for s in replica_stats().values())


def test_a_disconnected_stream_is_aborted_in_its_replica(ray_endpoint):
    # Far more tokens than are computed before the abort lands: 64 samples x 240 tokens.
    n, max_tokens = 64, 240
    body = {"model": MODEL_NAME, "prompt": "while True:", "max_tokens": max_tokens, "n": n}
    body |= {"stream": True, "ignore_eos": True}
    before = generated_tokens()
    with httpx.stream("POST", f"{ray_endpoint}/v1/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        events = stream.iter_lines()
        assert next(e for e in events if e.startswith("data:"))
    deadline = time.monotonic() + 30
    while any(s.num_running_seqs for s in replica_stats().values()):
        assert time.monotonic() < deadline, "the aborted stream still runs in its replica"
        time.sleep(0.2)
    assert generated_tokens() - before < n * max_tokens
    for stats in replica_stats().values():
        assert stats.num_free_blocks == stats.num_usable_blocks


async def stream_completion(
    client: httpx.AsyncClient, body: dict, streaming: list[str]
) -> tuple[str, int, list]:
    """(replica, status, events) of one streamed completion; its replica is appended to
    `streaming` when its first event arrives."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        replica = response.headers.get(REPLICA_HEADER, "")
        events: list[str] = []
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                if not events:
                    streaming.append(replica)
                events.append(line)
        return replica, response.status_code, events


def kill_replica_process(victim: ReplicaStats) -> None:
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#EngineReplica#{victim.replica_id}", "serve")
    ray.kill(actor, no_restart=True)


def kill_engine_core(victim: ReplicaStats) -> None:
    """The replica lives on with a dead engine: its health check fails and Ray replaces it."""
    os.kill(core_pid(victim.pid), signal.SIGKILL)


# Each fault, and what a stream it cuts ends with: the ingress's error for a replica that
# died, the replica's own (the server's) error for an engine core that died under it.
@pytest.mark.parametrize(
    ("fault", "cut_stream_error"),
    [(kill_replica_process, "replica_failed"), (kill_engine_core, "engine core process exited")],
)
def test_a_failed_replica_loses_only_its_requests_and_comes_back(
    ray_endpoint, fault, cut_stream_error
):
    before = replicas()
    victim = sorted(before)[0]
    # The router takes a replica only once it has seen it ready: on a loaded machine a
    # replica may answer stats before that, and then every stream would go to the other.
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while serving_replicas(ray_endpoint) != set(before):
        assert time.monotonic() < deadline, "the router never used both replicas"
    body = {"model": MODEL_NAME, "max_tokens": 200, "stream": True, "ignore_eos": True}

    async def load_then_fail() -> list:
        streaming: list[str] = []
        async with httpx.AsyncClient(base_url=ray_endpoint, timeout=120) as client:
            tasks = [
                asyncio.ensure_future(
                    stream_completion(client, body | {"prompt": f"{i} ="}, streaming)
                )
                for i in range(24)
            ]
            # The fault comes once every stream is under way (on both replicas): after a
            # fixed pause, a fast machine could have finished them all, and a request still
            # being routed could be refused by the ingress, on no replica.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + RECOVERY_TIMEOUT_S
            while len(streaming) < len(tasks) or set(streaming) != set(before):
                assert loop.time() < deadline, f"streams under way: {streaming}"
                await asyncio.sleep(STREAM_POLL_S)
            fault(before[victim])
            return await asyncio.wait_for(asyncio.gather(*tasks), RECOVERY_TIMEOUT_S)

    results = asyncio.run(load_then_fail())
    survivors = [events for replica, _, events in results if replica != victim]
    assert survivors, "no request ran on the surviving replica"
    for events in survivors:  # untouched: every token, then [DONE]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    failed = 0
    for replica, status, events in results:
        complete = status == 200 and events[-1] == "data: [DONE]" and '"error"' not in events[-2]
        if replica == victim or not complete:  # done before the kill, or failed cleanly
            failed += not complete
            assert complete or status == 503 or cut_stream_error in events[-2], events[-2:]
    assert failed, "no stream was cut by the fault"
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while True:  # Ray Serve replaces the replica, and the new one serves
        live = set(replicas())
        if len(live) == NUM_REPLICAS and victim not in live:
            break
        assert time.monotonic() < deadline, f"replica {victim} was not replaced: {live}"
        time.sleep(1)
    assert serving_replicas(ray_endpoint) == live


def serving_replicas(endpoint: str) -> set[str]:
    """The replicas that served a wave of 20 short requests, every one of which succeeded."""
    bodies = [{"model": MODEL_NAME, "prompt": f"{i} +", "max_tokens": 2} for i in range(20)]
    responses = asyncio.run(post_all(endpoint, bodies))
    assert {r.status_code for r in responses} == {200}
    return {r.headers[REPLICA_HEADER] for r in responses}
