"""--api-server-count 2: two API processes in front of one engine core, on one port.

Through the shared port the openai client gets what one server gives; both processes serve
(their connections are counted in /proc); a disconnect on either aborts in the core; /metrics
adds up both; a stop signal to the supervisor or to the whole process group drains both and
exits 0; a killed core ends the streams of both with an error and the server exits non-zero.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.server.conftest import (
    CHAT_TEMPLATE,
    MODEL_NAME,
    STREAM_TIMEOUT_S,
    LiveServer,
    StreamReader,
    live_server,
)

pytestmark = pytest.mark.slow

NUM_API_SERVERS = 2
# Concurrent streams: at least MIN_STREAMS, and more until both processes hold some (the
# kernel spreads connections by a hash: 2**-(MAX_STREAMS - 1) that they never do).
MIN_STREAMS, MAX_STREAMS = 4, 32
POLL_S = 0.05
STREAM_CHOICES = 8  # each stream lasts seconds: still in flight while more start
TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def socket_inodes(port: int, state: str, remote_port: int | None = None) -> set[str]:
    """Inodes of the TCP sockets on local `port` in `state` (/proc/net/tcp's hex codes),
    only those connected from `remote_port` if given."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
            if local == port and fields[3] == state and remote_port in (None, remote):
                inodes.add(fields[9])
    return inodes


def pids_holding(pids: list[int], inodes: set[str]) -> dict[int, int]:
    """How many of `inodes` each process holds open."""
    held = {}
    for pid in pids:
        targets = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                targets.append(os.readlink(fd))
            except FileNotFoundError:  # closed since the listing (a connection that ended)
                continue
        held[pid] = sum(t.removeprefix("socket:[").removesuffix("]") in inodes for t in targets)
    return held


def roles(server: LiveServer) -> tuple[list[int], int]:
    """(the API processes: those listening on the port, the engine core). /health answers
    once one API process serves; the others may still be starting (a spawned process takes
    its socket after importing), so this waits until all of them listen."""
    port = int(server.base_url.rsplit(":", 1)[1])
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while True:
        kids = [
            pid
            for pid in children(server.process.pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        listening = pids_holding(kids, socket_inodes(port, TCP_LISTEN))
        api = [pid for pid, count in listening.items() if count]
        if len(api) == NUM_API_SERVERS:
            (core,) = [pid for pid in kids if pid not in api]
            return api, core
        assert time.monotonic() < deadline, f"listening: {listening}"
        time.sleep(POLL_S)


def start_streams(server: LiveServer, body: dict) -> list[StreamReader]:
    """Streams started until both API processes were seen serving some (holding their
    connections while they stream)."""
    port = int(server.base_url.rsplit(":", 1)[1])
    api, _ = roles(server)
    assert len(api) == NUM_API_SERVERS
    readers: list[StreamReader] = []
    seen: set[int] = set()
    while len(readers) < MIN_STREAMS or seen != set(api):
        assert len(readers) < MAX_STREAMS, seen
        readers.append(StreamReader(server.base_url, body))
        readers[-1].start()
        assert readers[-1].started.wait(STREAM_TIMEOUT_S)
        held = pids_holding(api, socket_inodes(port, TCP_ESTABLISHED))
        seen |= {pid for pid, count in held.items() if count}
    return readers


def long_body(**extra) -> dict:
    return {
        "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 240, "temperature": 0,
        "ignore_eos": True, "stream": True, "n": STREAM_CHOICES, **extra,
    }  # fmt: skip


SERVER_FLAGS = ("--max-num-seqs", "64", "--max-num-batched-tokens", "512")


@pytest.fixture(scope="module")
def shared(tiny_model_dir, tmp_path_factory):
    with live_server(
        tiny_model_dir, tmp_path_factory.mktemp("api2"), *SERVER_FLAGS,
        "--chat-template", CHAT_TEMPLATE, "--api-server-count", str(NUM_API_SERVERS),
    ) as s:  # fmt: skip
        yield s


def test_the_openai_client_gets_what_one_server_gives(server, shared):
    one, two = (
        openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
        for s in (server, shared)
    )
    prompt = {"model": MODEL_NAME, "prompt": "Lists are", "max_tokens": 12}
    for _ in range(MIN_STREAMS):  # new connections each: both processes may answer
        sampled = {"n": 2, "seed": 7, "temperature": 0.9, "logprobs": 2}
        got, want = (c.completions.create(**prompt, **sampled) for c in (two, one))
        assert [c.text for c in got.choices] == [c.text for c in want.choices]
        assert got.choices[0].logprobs == want.choices[0].logprobs
        assert got.usage == want.usage
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
        got_chat, want_chat = (
            c.chat.completions.create(**chat, max_tokens=10, temperature=0) for c in (two, one)
        )
        assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
        greedy = one.completions.create(**prompt, temperature=0).choices[0].text
        events = list(two.completions.create(**prompt, temperature=0, stream=True))
        assert "".join(e.choices[0].text for e in events) == greedy
        assert events[-1].choices[0].finish_reason == "length"


def serving_pid(server: LiveServer, api: list[int], client_port: int) -> int:
    """The API process holding the server side of the connection from `client_port`."""
    port = int(server.base_url.rsplit(":", 1)[1])
    inodes = socket_inodes(port, TCP_ESTABLISHED, client_port)
    (pid,) = [pid for pid, count in pids_holding(api, inodes).items() if count]
    return pid


def test_disconnects_on_both_processes_abort_in_the_core(shared):
    # Each client leaves right after its first event, so no stream can finish first (however
    # slow the machine) and none waits in the queue behind another: clients are added until
    # both processes have served one that left.
    api, _ = roles(shared)
    generated_before = shared.metrics()["octavo:generation_tokens_total"]
    readers: list[StreamReader] = []
    left_from: set[int] = set()
    while len(readers) < MIN_STREAMS or left_from != set(api):
        assert len(readers) < MAX_STREAMS, left_from
        reader = StreamReader(shared.base_url, long_body())
        reader.start()
        assert reader.started.wait(STREAM_TIMEOUT_S)
        left_from.add(serving_pid(shared, api, reader.client_port))
        reader.stop.set()
        readers.append(reader)
    for reader in readers:
        reader.join(STREAM_TIMEOUT_S)
        assert not reader.is_alive()
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while (metrics := shared.metrics())["octavo:num_requests_running"] > 0:
        assert time.monotonic() < deadline, metrics
        time.sleep(POLL_S)
    assert metrics["octavo:kv_cache_usage_perc"] == 0
    assert all(None in r.finish_reasons() and "length" not in r.finish_reasons() for r in readers)
    # Aborted, not run to their length unread.
    full_length = len(readers) * STREAM_CHOICES * long_body()["max_tokens"]
    assert metrics["octavo:generation_tokens_total"] - generated_before < full_length


def test_metrics_add_up_both_processes(shared):
    e2e, itl = (
        "octavo:e2e_request_latency_seconds_count",
        "octavo:inter_token_latency_seconds_count",
    )
    before = shared.metrics()
    readers = start_streams(shared, long_body())
    for reader in readers:
        reader.join(STREAM_TIMEOUT_S)
        assert reader.finish_reasons()[-1] == "length"
    # A stream's inter-token latencies are its outputs but the first. An output carries an
    # event for each of its choices that progressed, one at least, all of them at most.
    events = [len(reader.finish_reasons()) for reader in readers]
    least = sum(-(-count // STREAM_CHOICES) - 1 for count in events)
    most = sum(count - 1 for count in events)
    # Both processes served some; whichever answers a scrape counts every request.
    for _ in range(NUM_API_SERVERS * 2):
        after = shared.metrics()
        assert after[e2e] - before[e2e] == len(readers)
        assert least <= after[itl] - before[itl] <= most


# systemd's SIGTERM reaches every process, a `kill -INT` the supervisor alone: one signal per
# API process either way (test_shutdown.py covers each signal to each target for one).
@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGTERM, True), (signal.SIGINT, False)],
    ids=["SIGTERM-process-group", "SIGINT-main-process"],
)
def test_a_stop_signal_drains_both_processes_and_exits_0(
    tiny_model_dir, tmp_path, signum, to_group
):
    flags = (*SERVER_FLAGS, "--api-server-count", str(NUM_API_SERVERS))
    with live_server(
        tiny_model_dir, tmp_path, *flags, "--shutdown-grace-seconds", "30", new_session=True
    ) as server:
        api, core = roles(server)
        readers = start_streams(server, long_body())
        if to_group:
            os.killpg(server.process.pid, signum)
        else:
            server.process.send_signal(signum)
        for reader in readers:
            reader.join(STREAM_TIMEOUT_S)
            assert not reader.is_alive()
        status = server.process.wait(timeout=STREAM_TIMEOUT_S)
    log = Path(server.log_path).read_text()
    assert status == 0 and "Traceback" not in log, log
    for reader in readers:  # within the grace: every stream completes
        assert reader.lines[-1] == "data: [DONE]" and reader.finish_reasons()[-1] == "length"
    assert not any(Path(f"/proc/{pid}").exists() for pid in (*api, core))


def test_a_killed_core_ends_the_streams_of_both_processes_and_the_server_fails(
    tiny_model_dir, tmp_path
):
    flags = (*SERVER_FLAGS, "--api-server-count", str(NUM_API_SERVERS))
    with live_server(tiny_model_dir, tmp_path, *flags) as server:
        api, core = roles(server)
        readers = start_streams(server, long_body())
        os.kill(core, signal.SIGKILL)
        for reader in readers:
            reader.join(STREAM_TIMEOUT_S)
            assert not reader.is_alive()
        status = server.process.wait(timeout=STREAM_TIMEOUT_S)
    assert status == 1, Path(server.log_path).read_text()
    # A stream may have finished before the kill, when starting the others took long (a
    # busy machine): it ends as usual. Every stream the kill cut ends with the error.
    cut = [r for r in readers if sum(f is not None for f in r.finish_reasons()) < STREAM_CHOICES]
    assert cut
    for reader in readers:
        assert reader.lines[-1] == "data: [DONE]"
    for reader in cut:
        assert reader.lines[-2].startswith('data: {"error"'), reader.lines[-2]
    assert not any(Path(f"/proc/{pid}").exists() for pid in api)


def test_a_port_in_use_is_a_clear_error_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "octavo", "serve", "--port", str(port),
             "--api-server-count", str(NUM_API_SERVERS)],
            capture_output=True, text=True, timeout=STREAM_TIMEOUT_S,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
