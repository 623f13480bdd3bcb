"""The SSE stream's bytes as the app writes them: framing, required fields, usage, [DONE]
(in-process; the framing is the app's, uvicorn only carries the bytes)."""

import json

import httpx

from tests.server.conftest import MODEL_NAME

REQUIRED = {"id", "object", "created", "model", "choices"}


def read_events(
    http: httpx.Client, body: dict, path: str = "/v1/completions"
) -> tuple[str, list[str]]:
    """A 200 event stream's text, and that text split at its blank lines."""
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text
    return raw, raw.split("\n\n")


def test_every_event_is_a_data_line_and_the_stream_ends_with_done(http):
    body = {
        "model": MODEL_NAME,
        "prompt": "Lists are",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "n": 2,
        "seed": 1,
    }
    raw, events = read_events(http, body)
    assert raw.endswith("data: [DONE]\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = []
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        chunks.append(json.loads(event.removeprefix("data: ")))
    *deltas, usage = chunks
    for chunk in deltas:
        assert REQUIRED.issubset(chunk) and chunk["object"] == "text_completion"
        assert chunk["model"] == MODEL_NAME and isinstance(chunk["created"], int)
        assert chunk["usage"] is None and len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        assert {"index", "text", "logprobs", "finish_reason"}.issubset(choice)
    assert len({c["id"] for c in chunks}) == 1
    finishes = {}
    for chunk in deltas:
        choice = chunk["choices"][0]
        assert choice["index"] not in finishes, "a chunk after the choice finished"
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    assert usage["choices"] == []
    counts = usage["usage"]
    assert counts["completion_tokens"] == 24 and counts["prompt_tokens"] > 0
    assert counts["total_tokens"] == counts["prompt_tokens"] + counts["completion_tokens"]


def test_streamed_text_never_holds_half_a_character_or_a_partial_stop(http):
    base = {
        "model": MODEL_NAME,
        "prompt": "The café menu",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = http.post("/v1/completions", json=base).json()
    text = full["choices"][0]["text"]
    stop = text[20:26]
    _, events = read_events(http, base | {"stream": True, "stop": [stop]})
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-2]]
    # Deltas only ever append: had a partial stop string been sent, it would be here.
    assert "".join(deltas) == text[: text.index(stop)]


def test_echo_prepends_the_prompt(http):
    body = {
        "model": MODEL_NAME,
        "prompt": "Echo me",
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
    }
    out = http.post("/v1/completions", json=body).json()
    plain = http.post("/v1/completions", json=body | {"echo": False}).json()
    assert out["choices"][0]["text"] == "Echo me" + plain["choices"][0]["text"]


def test_token_id_prompts_and_several_prompts(http):
    body = {
        "model": MODEL_NAME,
        "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
    }
    out = http.post("/v1/completions", json=body).json()
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 16
