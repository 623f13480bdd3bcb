"""Requests that once killed the engine or got a 500 (the app in-process): each is now a 4xx
naming the field, or an answer, and the app keeps serving everyone else; auth is
case-insensitive in its scheme and exact in its key. What needs a socket (a client that
leaves, chunked bodies, Host and header deadlines) is in tests/server/test_hardening.py."""

from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer
from tests.server.openai_errors import assert_error
from tests.server.test_load_and_disconnect import wait_for_idle

GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}


def post(http: httpx.Client, body: dict | bytes, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return http.post("/v1/completions", content=body, headers=headers, **kwargs)
    return http.post("/v1/completions", json=body, **kwargs)


def assert_still_serving(app_server: InProcessServer) -> None:
    assert app_server.http.get("/health").status_code == 200
    response = post(app_server.http, GOOD)
    assert response.status_code == 200, response.text
    assert wait_for_idle(app_server, timeout=5.0)["octavo:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("seed", [2**64 - 1, 2**70, -(2**63) - 1])
def test_out_of_range_seeds_are_400_and_the_engine_lives(app_server, http, seed, stream):
    response = post(http, GOOD | {"n": 2, "seed": seed, "stream": stream})
    assert_error(response, 400, "seed")
    assert_still_serving(app_server)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("top_k", [2**63, 2**70])
def test_top_k_past_int64_is_400_and_the_engine_lives(app_server, http, top_k, stream):
    # Once taken, it failed the first step it ran in: the engine core died with it.
    response = post(http, GOOD | {"top_k": top_k, "temperature": 1.0, "stream": stream})
    assert_error(response, 400, "top_k")
    assert_still_serving(app_server)


def test_the_largest_top_k_keeps_every_token(http):
    # Any top_k from the vocabulary's size up filters nothing: the same draw as no top_k.
    body = GOOD | {"temperature": 1.0, "seed": 3, "max_tokens": 8}
    texts = [post(http, body | {"top_k": k}).json()["choices"][0]["text"] for k in (0, 2**63 - 1)]
    assert texts[0] == texts[1]


def test_the_largest_seeds_with_parallel_samples_work(http):
    for seed in (2**63 - 1, -(2**63)):
        response = post(http, GOOD | {"n": 4, "seed": seed, "temperature": 1.0})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 4


@pytest.mark.parametrize("length_penalty", [400.0, -1e308, 1e308])
def test_extreme_length_penalties_finish_and_the_engine_lives(app_server, http, length_penalty):
    body = GOOD | {"use_beam_search": True, "best_of": 2, "length_penalty": length_penalty}
    response = post(http, body | {"max_tokens": 6})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    assert_still_serving(app_server)


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
        (b'{"model": "tiny", "prompt": "x", "guided_json": 5}', "guided_json"),
        (b'{"model": "tiny", "prompt": "x", "guided_regex": "\\ud800"}', "guided_regex"),
    ],
)
def test_bad_values_are_400_naming_the_field_never_500(http, raw, param):
    assert_error(post(http, raw), 400, param)
    if b'"stream"' not in raw:  # the same as a stream: refused before any event is sent
        assert_error(post(http, raw[:-1] + b', "stream": true}'), 400, param)


@pytest.mark.parametrize("depth", [900, 5000])  # within json's recursion limit, and past it
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": DEEP_ARRAY}'),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "guided_json": DEEP_OBJECT}'),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": DEEP_OBJECT}'),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema", '
            b'"json_schema": {"name": "s", "schema": DEEP_OBJECT}}}',
        ),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": DEEP_ARRAY}'),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": DEEP_ARRAY}]}',
        ),
    ],
)
def test_deeply_nested_bodies_are_400_never_500(http, path, body, depth):
    deep_array = b"[" * depth + b"1" + b"]" * depth
    deep_object = b'{"a": ' * depth + b"1" + b"}" * depth
    raw = body.replace(b"DEEP_ARRAY", deep_array).replace(b"DEEP_OBJECT", deep_object)
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_null_means_the_default_and_unknown_fields_are_ignored(http):
    nulls = {
        "temperature": None, "top_p": None, "n": None, "stream": None, "stop": None,
        "presence_penalty": None, "frequency_penalty": None, "seed": None, "echo": None,
        "logprobs": None, "user": None, "best_of": None, "stream_options": None,
    }  # fmt: skip
    response = post(http, GOOD | nulls | {"a_field_nobody_defined": 3})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_too_many_prompts_in_one_request_is_a_400(http):
    assert_error(post(http, GOOD | {"prompt": ["x"] * 300}), 400, "prompt")


@pytest.fixture(scope="module")
def keyed(tiny_model_dir) -> Iterator[httpx.Client]:
    """An app like the shared one, with --api-key s3cret."""
    app = InProcessServer(tiny_model_dir, api_keys={"s3cret": "key0"})
    try:
        yield app.http
    finally:
        app.close()


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
def test_bearer_scheme_is_case_insensitive_and_the_key_exact(keyed, authorization, status):
    headers = {"authorization": authorization} if authorization else {}
    response = post(keyed, GOOD, headers=headers)
    assert response.status_code == status, response.text
    if status == 401:
        assert_error(response, 401)


@pytest.mark.parametrize(
    ("change", "param"),
    [({"n": 17}, "n"), ({"use_beam_search": True, "best_of": 17}, "best_of")],
)
def test_one_request_cannot_take_every_sequence_slot(http, change, param):
    """The app has max_num_seqs 64, so max_n is 16 (--max-n's default)."""
    assert_error(post(http, GOOD | change), 400, param)
