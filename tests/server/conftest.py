"""Live `octavo serve` processes on free loopback ports, started by the tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

MODEL_NAME = "tiny"
# ChatML, with an optional template variable (chat_template_kwargs) before the conversation.
CHAT_TEMPLATE = (
    "{% if preamble is defined %}{{ preamble + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with Hermes-style tools (as Qwen's and Hermes' templates, shortened for the tiny
# model's 256 positions): the tools' names in a system turn, an assistant's calls as
# <tool_call> blocks, tool results as <tool_response> in a user turn.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: "
    "{% for tool in tools %}{{ tool['function']['name'] }} {% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant\n{% for call in message['tool_calls'] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "\n</tool_call>\n{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STARTUP_TIMEOUT_S = 60
STREAM_TIMEOUT_S = 60


class StreamReader(threading.Thread):
    """Streams one completion request in a thread and keeps its status, its non-empty lines
    and its connection's local port; `started` is set at its first event; setting `stop`
    closes the connection after the next event (a client that leaves)."""

    def __init__(self, base_url: str, body: dict):
        super().__init__()
        self.url = f"{base_url}/v1/completions"
        self.body = body
        self.status: int | None = None
        self.lines: list[str] = []
        self.client_port: int | None = None
        self.started = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=STREAM_TIMEOUT_S) as response:
            self.status = response.status_code
            _, self.client_port = response.extensions["network_stream"].get_extra_info(
                "client_addr"
            )
            for line in response.iter_lines():
                if line:
                    self.lines.append(line)
                    self.started.set()
                if self.stop.is_set():
                    return

    def chunks(self) -> list[dict]:
        """The JSON events before the final `data: [DONE]`."""
        return [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]

    def finish_reasons(self) -> list[str | None]:
        """Every choice's finish_reason, event by event (those read so far)."""
        return [
            choice["finish_reason"]
            for line in self.lines
            if line.startswith("data: {")
            for choice in json.loads(line.removeprefix("data: ")).get("choices", [])
        ]


@dataclass
class LiveServer:
    process: subprocess.Popen
    base_url: str
    log_path: str

    def metrics(self) -> dict[str, float]:
        """The octavo:* samples of /metrics (histogram buckets excluded)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("octavo:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child that multiprocessing spawned (not its resource
    tracker)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline:
            return int(pid)
    raise AssertionError(f"no engine core among the children {children}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running_processes() -> str:
    """The pid and command line of every process in this session (from /proc): what a server
    that did not start waited on or competed with (a compiler, a server an earlier test left)."""
    lines = []
    for pid in sorted(int(name) for name in os.listdir("/proc") if name.isdigit()):
        entry = Path("/proc", str(pid))
        try:
            # stat's fields after the command's parenthesised name: state, ppid, pgrp, session.
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended since the listing
            continue
        if session == os.getsid(0):
            lines.append(f"{pid} {args[:300]}")
    return "\n".join(lines)


@contextmanager
def live_server(
    model_dir: str | None, tmp_path, *extra: str, new_session: bool = False
) -> Iterator[LiveServer]:
    """`octavo serve` on a free port; model_dir None serves the embedded default model.
    `new_session`: the server leads a process group of its own (as under systemd or in a
    terminal), which os.killpg(server.process.pid, ...) signals as a whole."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    model = ["--model", model_dir, "--served-model-name", MODEL_NAME] if model_dir else []
    cmd = [sys.executable, "-m", "octavo", "serve", *model, "--port", str(port)]
    cmd += ["--device", "cpu", "--num-blocks", "1024", "--block-size", "8"]
    cmd += ["--log-level", "warning", *extra]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session
        )
    server = LiveServer(process, f"http://127.0.0.1:{port}", str(log_path))
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # One client for every poll: each new one builds an SSL context, tens of ms of the
        # CPU the starting server needs.
        with httpx.Client(timeout=1) as poller:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"server exited: {log_path.read_text()}")
                try:
                    if poller.get(f"{server.base_url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"server did not start: {log_path.read_text()}\n"
                        f"processes running:\n{running_processes()}"
                    )
                time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the shared server, without retries."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    with live_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("srv"),
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "512",
        "--chat-template",
        CHAT_TEMPLATE,
    ) as s:
        yield s
