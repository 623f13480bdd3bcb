"""What needs a live server's socket or command line: a non-streaming client that leaves
aborts its request; an empty --api-key is refused at startup; a chunked body over the limit
is a 413 and the server keeps serving; the Host check on loopback and --allowed-hosts; a
connection that never finishes its headers is closed. The requests that once killed the
engine or got a 500 are checked in-process (inprocess/test_hardening.py)."""

import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, live_server
from tests.server.openai_errors import assert_error
from tests.server.test_load_and_disconnect import wait_for_idle

pytestmark = pytest.mark.slow

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
