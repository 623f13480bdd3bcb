"""Token controls over HTTP: OpenAI's logit_bias (string keys, clamped), vLLM's
allowed_token_ids, bad_words and truncate_prompt_tokens (the app in-process)."""

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

PROMPT = [17, 230, 41, 99, 5, 311]


def complete(http: httpx.Client, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True} | body  # fmt: skip
    return http.post("/v1/completions", json=body)


def text_of(http: httpx.Client, tokens: list[int]) -> str:
    response = http.post("/detokenize", json={"tokens": tokens})
    return response.json()["prompt"]


def test_logit_bias_forces_a_token_and_is_clamped_to_100(http):
    forced = complete(http, logit_bias={"300": 100}).json()["choices"][0]["text"]
    assert forced == text_of(http, [300] * 8)
    # 10**6 is clamped to 100: the same completion.
    huge = complete(http, logit_bias={"300": 1e6}).json()["choices"][0]["text"]
    assert huge == forced


@pytest.mark.parametrize(
    "bias", [{"abc": 1}, {"-3": 1}, {"1.5": 1}, {"100000000": 1}, {"5": "x"}, {"5": None}]
)
def test_bad_logit_bias_is_a_400_naming_it(http, bias):
    response = complete(http, logit_bias=bias)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logit_bias"


def test_allowed_token_ids_restrict_the_vocabulary(http):
    text = complete(http, allowed_token_ids=[300]).json()["choices"][0]["text"]
    assert text == text_of(http, [300] * 8)
    response = complete(http, allowed_token_ids=[])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_keep_a_word_out(http):
    body = {"prompt": "The class definition", "max_tokens": 12, "logprobs": 0}
    plain = complete(http, **body).json()["choices"][0]

    def one_token(text: str) -> bool:
        response = http.post("/tokenize", json={"prompt": text})
        return response.json()["count"] == 1

    # A word the model writes that is one token both alone and after a space: banning it
    # bans both tokens (vLLM's rule), so neither may appear.
    word = next(
        t.strip()
        for t in plain["logprobs"]["tokens"]
        if t.strip().isalpha() and one_token(t.strip()) and one_token(" " + t.strip())
    )
    banned = complete(http, **body, bad_words=[word]).json()["choices"][0]
    assert word not in [t.strip() for t in banned["logprobs"]["tokens"]]
    assert banned["text"] != plain["text"]


def test_truncate_prompt_tokens_keeps_the_last_ones(http):
    out = complete(http, truncate_prompt_tokens=3, echo=True, max_tokens=2).json()
    assert out["usage"]["prompt_tokens"] == 3
    kept = http.post("/detokenize", json={"tokens": PROMPT[-3:]})
    assert out["choices"][0]["text"].startswith(kept.json()["prompt"])


def test_beam_search_refuses_token_controls(http):
    response = complete(http, use_beam_search=True, n=2, logit_bias={"5": 1.0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logit_bias"


def test_best_of_returns_n_choices_and_cannot_stream(http):
    body = {"n": 2, "best_of": 4, "temperature": 1.0, "seed": 5, "logprobs": 0}
    out = complete(http, **body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in out["choices"]]
    assert totals[0] >= totals[1]
    for bad in ({"stream": True}, {"best_of": 1}):
        response = complete(http, **(body | bad))
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "best_of"
