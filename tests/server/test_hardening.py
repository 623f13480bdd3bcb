"""Requests that once killed the engine or got a 500: each is now a 4xx naming the
field, or an answer, and the server keeps serving everyone else; a non-streaming client that
leaves aborts its request; auth is constant-time and case-insensitive in its scheme."""

import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, live_server
from tests.server.openai_errors import assert_error
from tests.server.test_load_and_disconnect import wait_for_idle

GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}


def post(server, body: dict | bytes, **kwargs) -> httpx.Response:
    url = f"{server.base_url}/v1/completions"
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=60, **kwargs)
    return httpx.post(url, json=body, timeout=60, **kwargs)


def assert_still_serving(server) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    response = post(server, GOOD)
    assert response.status_code == 200, response.text
    assert wait_for_idle(server, timeout=5.0)["octavo:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("seed", [2**64 - 1, 2**70, -(2**63) - 1])
def test_out_of_range_seeds_are_400_and_the_engine_lives(server, seed, stream):
    response = post(server, GOOD | {"n": 2, "seed": seed, "stream": stream})
    assert_error(response, 400, "seed")
    assert_still_serving(server)


def test_the_largest_seeds_with_parallel_samples_work(server):
    for seed in (2**63 - 1, -(2**63)):
        response = post(server, GOOD | {"n": 4, "seed": seed, "temperature": 1.0})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 4


@pytest.mark.parametrize("length_penalty", [400.0, -1e308, 1e308])
def test_extreme_length_penalties_finish_and_the_engine_lives(server, length_penalty):
    body = GOOD | {"use_beam_search": True, "best_of": 2, "length_penalty": length_penalty}
    response = post(server, body | {"max_tokens": 6})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        (b'{"model": "tiny", "prompt": ["ok", "a\\udfffb"]}', "prompt"),
        (b'{"model": "\\ud800", "prompt": "x"}', "model"),
        (b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', "stop"),
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"model": "tiny", "prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
        (b'{"model": "tiny", "prompt": "x", "length_penalty": -Infinity}', "length_penalty"),
        (b'{"model": "tiny", "prompt": [true, false]}', "prompt"),
        (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "stream"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"model": "tiny", "prompt": "x", "n": 2.5}', "n"),
        (b'{"model": "tiny", "prompt": [1, 2.5]}', "prompt"),
        (b'{"model": "tiny", "prompt": "x", "prompt_logprobs": 21}', "prompt_logprobs"),
        (b'{"model": "tiny", "prompt": "x", "prompt_logprobs": -1}', "prompt_logprobs"),
        (b'{"model": "tiny", "prompt": "x", "allowed_token_ids": [true]}', "allowed_token_ids"),
        (b'{"model": "tiny", "prompt": "x", "bad_words": ["\\ud800"]}', "bad_words"),
        (
            b'{"model": "tiny", "prompt": "x", "truncate_prompt_tokens": 0}',
            "truncate_prompt_tokens",
        ),
        (b'{"model": "tiny", "prompt": "x", "response_format": {}}', "response_format"),
        (b'{"model": "tiny", "prompt": "x", "guided_json": {}}', "guided_json"),
    ],
)
def test_bad_values_are_400_naming_the_field_never_500(server, raw, param):
    assert_error(post(server, raw), 400, param)
    if b'"stream"' not in raw:  # the same as a stream: refused before any event is sent
        assert_error(post(server, raw[:-1] + b', "stream": true}'), 400, param)


def test_null_means_the_default_and_unknown_fields_are_ignored(server):
    nulls = {
        "temperature": None, "top_p": None, "n": None, "stream": None, "stop": None,
        "presence_penalty": None, "frequency_penalty": None, "seed": None, "echo": None,
        "logprobs": None, "user": None, "best_of": None, "stream_options": None,
    }  # fmt: skip
    response = post(server, GOOD | nulls | {"a_field_nobody_defined": 3})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_too_many_prompts_in_one_request_is_a_400(server):
    assert_error(post(server, GOOD | {"prompt": ["x"] * 300}), 400, "prompt")


def test_a_non_streaming_client_that_leaves_aborts_its_request(server):
    # Four prompts x 16 samples x 240 tokens: far more than the client's half second buys,
    # however fast the server has become.
    body = {
        "model": MODEL_NAME, "prompt": ["The class"] * 4, "max_tokens": 240, "n": 16,
        "temperature": 1.0, "ignore_eos": True,
    }  # fmt: skip
    before = server.metrics()["octavo:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.5)
    left = time.monotonic()
    metrics = wait_for_idle(server, timeout=3.0)
    assert metrics["octavo:num_requests_running"] == 0, metrics
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
    assert time.monotonic() - left < 3.0
    generated = metrics["octavo:generation_tokens_total"] - before
    assert generated < 4 * 16 * 240, "the request ran to completion after its client left"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, tmp_path_factory):
    with live_server(tiny_model_dir, tmp_path_factory.mktemp("key"), "--api-key", "s3cret") as s:
        yield s


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        ("Bearer s3cret", 200),
        ("bearer s3cret", 200),
        ("BEARER  s3cret", 200),
        ("Bearer s3cre", 401),
        ("Bearer s3cret2", 401),
        ("Basic s3cret", 401),
        ("s3cret", 401),
        ("", 401),
    ],
)
def test_bearer_scheme_is_case_insensitive_and_the_key_exact(keyed_server, authorization, status):
    headers = {"authorization": authorization} if authorization else {}
    response = post(keyed_server, GOOD, headers=headers)
    assert response.status_code == status, response.text
    if status == 401:
        assert_error(response, 401)


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused_at_startup(tiny_model_dir, key):
    command = [sys.executable, "-m", "octavo", "serve", "--model", tiny_model_dir,
               "--device", "cpu", "--num-blocks", "64", "--api-key", key]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "api-key" in run.stderr


def test_a_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):  # 5 MiB in all, past the 4 MiB default, with no Content-Length
            yield b"x" * (64 << 10)
        yield b'"}'

    response = httpx.post(
        f"{server.base_url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert_error(response, 413)
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("change", "param"),
    [({"n": 17}, "n"), ({"use_beam_search": True, "best_of": 17}, "best_of")],
)
def test_one_request_cannot_take_every_sequence_slot(server, change, param):
    """The test server has max_num_seqs 64, so --max-n defaults to 16."""
    assert_error(post(server, GOOD | change), 400, param)


def test_a_foreign_host_header_is_refused_on_loopback(server):
    port = server.base_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2"):
        response = post(server, GOOD, headers={"host": host})
        assert_error(response, 400)
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}"):
        assert post(server, GOOD, headers={"host": host}).status_code == 200


@pytest.fixture(scope="module")
def guarded_server(tiny_model_dir, tmp_path_factory):
    flags = ("--header-timeout-seconds", "0.5", "--allowed-hosts", "api.example,localhost")
    with live_server(tiny_model_dir, tmp_path_factory.mktemp("guard"), *flags) as s:
        yield s


def test_a_connection_that_never_finishes_its_headers_is_closed(guarded_server):
    host, port = guarded_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        started = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server, not by our 5 s timeout
        assert time.monotonic() - started < 3.0
    # A well-behaved client on a kept-alive connection is not cut by the deadline.
    headers = {"host": "localhost"}
    with httpx.Client(base_url=guarded_server.base_url, timeout=30, headers=headers) as client:
        for _ in range(3):
            assert client.post("/v1/completions", json=GOOD).status_code == 200
            time.sleep(0.6)


def test_allowed_hosts_can_be_set(guarded_server):
    assert post(guarded_server, GOOD, headers={"host": "api.example"}).status_code == 200
    assert_error(post(guarded_server, GOOD, headers={"host": "127.0.0.1"}), 400)
