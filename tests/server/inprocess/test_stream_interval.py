"""--stream-interval N over HTTP: fewer events, the first token at once, and the events of
every stream concatenating to exactly what a server with interval 1 streams (text, logprobs,
usage) for n > 1, echo, stop strings and chat. Both apps in-process: the batching is the
engine's and the app's, the bytes are the same over a socket."""

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer

INTERVAL = 6


def first_token_at_once(sizes: list[int]) -> bool:
    """Whether a stream's first event came before the interval filled up: one token, or a
    few more when the in-process client read a step or two behind the engine (a lagging
    reader gets every step since it last read in one event). A server that held the first
    token back would send it with INTERVAL tokens at least. The output processor's tests show
    the first output is due after exactly one token."""
    return 1 <= sizes[0] < INTERVAL


@pytest.fixture(scope="module")
def unbatched(http) -> httpx.Client:
    """The shared app: a stream event per token."""
    return http


@pytest.fixture(scope="module")
def batched(tiny_model_dir) -> Iterator[httpx.Client]:
    """An app like the shared one, streaming every INTERVAL tokens."""
    app = InProcessServer(tiny_model_dir, engine_args={"stream_interval": INTERVAL})
    try:
        yield app.http
    finally:
        app.close()


def stream(http: httpx.Client, route: str, body: dict) -> list[dict]:
    """The chunks of one stream, [DONE] checked last."""
    response = http.post(route, json=body)
    assert response.status_code == 200
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def per_choice(chunks: list[dict], content) -> dict[int, list]:
    """Each choice's events in order: `content(choice)` of every chunk that has one."""
    events: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            events.setdefault(choice["index"], []).append(content(choice))
    return events


def completion_tokens(choice: dict) -> list[str]:
    return choice["logprobs"]["tokens"]


def test_completions_concatenate_to_the_unbatched_stream(unbatched, batched):
    body = {
        "model": MODEL_NAME, "prompt": "Lists are", "max_tokens": 14, "n": 2, "seed": 3,
        "temperature": 0.9, "logprobs": 2, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }  # fmt: skip
    every = stream(unbatched, "/v1/completions", body)
    fewer = stream(batched, "/v1/completions", body)
    assert fewer[-1]["usage"] == every[-1]["usage"]
    assert every[-1]["usage"]["completion_tokens"] == 28
    assert len(fewer) < len(every)
    for index in (0, 1):
        for field in ("text", "logprobs"):

            def joined(chunks, field=field, index=index):
                parts = per_choice(chunks[:-1], lambda c, f=field: c[f])[index]
                if field == "text":
                    return "".join(parts)
                return {key: sum((p[key] for p in parts), []) for key in parts[0]}

            assert joined(fewer) == joined(every)
        sizes = [len(t) for t in per_choice(fewer[:-1], completion_tokens)[index]]
        assert first_token_at_once(sizes)
        assert all(size >= INTERVAL for size in sizes[1:-1]) and sum(sizes) == 14


def test_echo_and_a_stop_string_split_across_tokens(unbatched, batched):
    base = {"model": MODEL_NAME, "prompt": "The list", "max_tokens": 16, "temperature": 0}
    text = unbatched.post("/v1/completions", json=base).json()
    generated = text["choices"][0]["text"]
    stop = generated[6:9]  # from the middle: the output must end where it starts
    assert stop and stop in generated
    body = {**base, "stop": [stop], "echo": True, "logprobs": 0, "stream": True}
    every = stream(unbatched, "/v1/completions", body)
    fewer = stream(batched, "/v1/completions", body)
    whole = "".join(c["choices"][0]["text"] for c in fewer)
    assert whole == "".join(c["choices"][0]["text"] for c in every)
    assert whole == "The list" + generated[: generated.index(stop)]
    assert fewer[-1]["choices"][0]["finish_reason"] == "stop"
    assert fewer[-1]["choices"][0]["stop_reason"] == stop


def test_chat_concatenates_to_the_unbatched_stream(unbatched, batched):
    body = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a list."}],
        "max_tokens": 13, "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    every = stream(unbatched, "/v1/chat/completions", body)
    fewer = stream(batched, "/v1/chat/completions", body)
    assert fewer[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [
        per_choice(chunks[1:], lambda c: c["delta"]["content"])[0] for chunks in (every, fewer)
    ]
    assert "".join(contents[1]) == "".join(contents[0])
    logprobs = [
        per_choice(chunks[1:], lambda c: c["logprobs"]["content"])[0] for chunks in (every, fewer)
    ]
    assert sum(logprobs[1], []) == sum(logprobs[0], [])
    sizes = [len(entries) for entries in logprobs[1]]
    assert first_token_at_once(sizes)
    assert all(size >= INTERVAL for size in sizes[1:-1]) and sum(sizes) == 13
    assert len(fewer) < len(every)
