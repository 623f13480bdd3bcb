"""/metrics against what a request did: the engine's counters move by what it computed."""

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
