"""Fuzzing the HTTP API (the app in-process): whatever a client sends, the answer is a 200 or
an OpenAI-shaped 4xx, never a 5xx, and afterwards nothing is left running and every KV block
is free. A property-based test over every completion field (extreme and ill-typed values) and
every chat field; the schemathesis run over /openapi.json is in tests/server/test_fuzz.py."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME
from tests.server.test_load_and_disconnect import wait_for_idle

# Values that have broken JSON APIs: ill-typed, extreme, non-finite, invalid Unicode.
ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udfffb", "never", "yes", ""]),
    st.lists(st.integers(min_value=-5, max_value=2**20), max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = [
    "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs", "echo",
    "stop", "presence_penalty", "frequency_penalty", "seed", "user", "best_of", "suffix",
    "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "use_beam_search",
    "length_penalty", "early_stopping", "prompt", "model", "prompt_logprobs", "made_up_field",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs", "response_format",
]  # fmt: skip
# Keeps each generation short, so a hundred requests take seconds.
SMALL = {"model": MODEL_NAME, "prompt": "The class", "max_tokens": 3}


def encode(body: dict) -> bytes:
    """JSON as Python writes it: NaN/Infinity literals and lone surrogates pass through."""
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return http.post(path, content=body, headers=headers)


def check_answer(response: httpx.Response, changes: dict) -> None:
    """A 200 that finished normally (streamed: ended by [DONE], without an error event), or
    an OpenAI-shaped 4xx; never a 5xx."""
    assert response.status_code < 500, (changes, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text, response.text
    else:
        choices = response.json()["choices"]
        reasons = ("stop", "length", "tool_calls")
        assert choices and all(c["finish_reason"] in reasons for c in choices)


# Both fuzzers: reproducible, and slow examples (a generation each) are expected.
FUZZ_SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@settings(max_examples=150, **FUZZ_SETTINGS)
@given(changes=st.dictionaries(st.sampled_from(FIELDS), ANYTHING, min_size=1, max_size=4))
def test_no_completion_request_gets_a_server_error(http, changes):
    body = encode(SMALL | changes)
    check_answer(post_raw(http, "/v1/completions", body), changes)


CHAT_FIELDS = [
    "messages", "max_tokens", "max_completion_tokens", "temperature", "n", "stream",
    "stream_options", "logprobs", "top_logprobs", "stop", "seed", "logit_bias", "best_of",
    "use_beam_search", "prompt_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "made_up_field",
]  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {}, optional={"role": ANYTHING, "content": ANYTHING, "name": ANYTHING}
)
# Tools and tool choices near the valid ones: a name that may or may not be valid, odd
# parameter schemas, the modes and named choices.
TOOL_NAME = st.sampled_from(["f", "get_weather", "", "bad name", "x" * 65])
PARAMETERS = st.one_of(
    ANYTHING,
    st.sampled_from([
        {"type": "object"}, {"type": "nonsense"}, {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}},
         "required": ["a"]},
        {"$ref": "#/nowhere"},
    ]),
)  # fmt: skip
TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search"])},
    optional={"function": st.fixed_dictionaries(
        {"name": TOOL_NAME}, optional={"parameters": PARAMETERS, "strict": ANYTHING})},
)  # fmt: skip
TOOL_CHOICE = st.one_of(
    st.sampled_from(["none", "auto", "required", "any"]),
    st.fixed_dictionaries({"type": st.just("function"),
                           "function": st.fixed_dictionaries({"name": TOOL_NAME})}),
)  # fmt: skip
# A chat field's value: anything, a list of (odd) messages, tools or a tool choice.
CHAT_VALUES = st.one_of(
    ANYTHING, st.lists(st.one_of(MESSAGE, ANYTHING), max_size=3), st.lists(TOOL, max_size=3),
    TOOL_CHOICE,
)  # fmt: skip
SMALL_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@settings(max_examples=100, **FUZZ_SETTINGS)
@given(changes=st.dictionaries(st.sampled_from(CHAT_FIELDS), CHAT_VALUES, min_size=1, max_size=4))
def test_no_chat_request_gets_a_server_error(http, changes):
    check_answer(post_raw(http, "/v1/chat/completions", encode(SMALL_CHAT | changes)), changes)


# The values at the edges of what JSON and int64 can say: every field gets each one alone,
# where the property tests above draw them only now and then (top_k = 2**63 once killed the
# engine core and no drawn example had tried it).
EXTREMES = [
    None, True, -1, 0, 2**63 - 1, 2**63, -(2**63) - 1, 2**70, 1e308, -1e308, float("nan"),
    float("inf"), "\ud800", "", [], {}, [2**63], {str(2**63): 1.0}, [[2**63]],
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "base", "fields"),
    [("/v1/completions", SMALL, FIELDS), ("/v1/chat/completions", SMALL_CHAT, CHAT_FIELDS)],
    ids=["completions", "chat"],
)
def test_every_field_takes_every_extreme_value_without_a_server_error(
    app_server, http, path, base, fields
):
    for field in fields:
        for value in EXTREMES:
            changes = {field: value}
            check_answer(post_raw(http, path, encode(base | changes)), changes)
    response = http.post("/v1/completions", json=SMALL)  # the engine lives on
    assert response.status_code == 200, response.text


def test_the_server_is_idle_and_serving_after_the_fuzzing(app_server, http):
    response = http.post("/v1/completions", json=SMALL)
    assert response.status_code == 200, response.text
    metrics = wait_for_idle(app_server, timeout=5.0)
    assert metrics["octavo:num_requests_running"] == 0, metrics
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
