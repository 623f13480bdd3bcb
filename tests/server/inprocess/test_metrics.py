"""/metrics against what a request did: the engine's counters move by what it computed, the
latency histograms by what the client got."""

import pytest

from tests.server.conftest import MODEL_NAME

MAX_TOKENS = 7


def test_a_lone_request_of_n_tokens_counts_n_engine_steps(app_server, client):
    """Alone on the engine (CPU: no step scheduled ahead), a greedy request's prompt takes
    one step, which samples its first token, and each further token one more: engine_steps,
    from which a benchmark reads tokens per step (the batch's fill), counts exactly those."""
    before = app_server.metrics()
    client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = app_server.metrics()
    for counter in ("octavo:engine_steps_total", "octavo:generation_tokens_total"):
        assert after[counter] - before[counter] == MAX_TOKENS, counter


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_streams_inter_token_latencies_are_its_events_after_the_first(app_server, client, route):
    """One latency per event of a choice after its first (n=1: an output is one event)."""
    name = "octavo:inter_token_latency_seconds"
    before = app_server.metrics()
    if route == "completions":
        stream = client.completions.create(
            model=MODEL_NAME, prompt="Hello there", max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        events = [chunk for chunk in stream if chunk.choices]
    else:
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        events = [
            chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.role is None
        ]
    after = app_server.metrics()
    assert len(events) > 1
    assert after[f"{name}_count"] - before[f"{name}_count"] == len(events) - 1
    assert after[f"{name}_sum"] > before[f"{name}_sum"]
