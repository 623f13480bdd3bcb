"""Scoring over HTTP: echo + logprobs return the prompt's log-probabilities in OpenAI's shape
(what lm-evaluation-harness's loglikelihood tasks send and parse), and streamed logprobs
line up with the non-streamed ones (the app in-process)."""

import json

import pytest
import torch

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.test_sse_framing import read_events

PROMPT_IDS = [17, 230, 41, 99, 5, 311, 64, 150, 12, 77, 401, 8]
CONTEXT_LEN = 8  # lm-eval's split: context tokens, then the continuation to score


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL_NAME} | body)
    assert response.status_code == 200, response.text
    return response.json()


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: log_softmax of the logits at each position (fp32)."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_lm_eval_loglikelihood_request(http, hf_tiny):
    # The body lm-eval's `local-completions` model sends for a loglikelihood request.
    out = complete(
        http, prompt=PROMPT_IDS, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    # The echoed prompt's tokens, then the one generated token.
    assert len(logprobs["tokens"]) == len(PROMPT_IDS) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = hf_logprobs(hf_tiny, PROMPT_IDS)
    for position in range(1, len(PROMPT_IDS)):
        want = expected[position - 1, PROMPT_IDS[position]].item()
        assert logprobs["token_logprobs"][position] == pytest.approx(want, abs=1e-4)
        top = logprobs["top_logprobs"][position]
        assert logprobs["tokens"][position] in top  # the prompt token, then the best one
        best = expected[position - 1].max().item()
        assert max(top.values()) == pytest.approx(best, abs=1e-4)
    # lm-eval's parse: the continuation's log-likelihood and whether greedy would produce it.
    continuation = logprobs["token_logprobs"][CONTEXT_LEN:-1]
    scored = range(CONTEXT_LEN, len(PROMPT_IDS))
    want = sum(expected[p - 1, PROMPT_IDS[p]].item() for p in scored)
    assert sum(continuation) == pytest.approx(want, abs=1e-3)
    greedy = all(
        token == max(top, key=top.get)
        for token, top in zip(
            logprobs["tokens"][CONTEXT_LEN:-1], logprobs["top_logprobs"][CONTEXT_LEN:-1],
            strict=True,
        )
    )  # fmt: skip
    want_greedy = all(expected[p - 1].argmax().item() == PROMPT_IDS[p] for p in scored)
    assert greedy == want_greedy
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False)
    )
    assert out["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert out["usage"]["completion_tokens"] == 1


def test_max_tokens_zero_scores_the_prompt_alone(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="The quick brown fox", echo=True, logprobs=2, max_tokens=0
    )
    choice = out.choices[0]
    assert choice.text == "The quick brown fox"
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in choice.logprobs.token_logprobs[1:])
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(choice.logprobs.tokens)
    # Without logprobs the echo is the prompt alone too.
    plain = client.completions.create(model=MODEL_NAME, prompt="Hi there", echo=True, max_tokens=0)
    assert plain.choices[0].text == "Hi there" and plain.choices[0].logprobs is None


def test_max_tokens_zero_needs_echo(http):
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def streamed_logprobs(http, body: dict) -> tuple[str, dict[str, list]]:
    """The choice's text and logprobs lists, concatenated over the stream's events."""
    _, events = read_events(http, body | {"model": MODEL_NAME, "stream": True})
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events[:-2]:
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        text += choice["text"]
        for key in merged:
            merged[key] += choice["logprobs"][key]
    return text, merged


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Lists are", "echo": True, "logprobs": 2, "max_tokens": 6},
        # Held-back text (a stop string's prefix) must not shift text_offset.
        {"prompt": "The café menu", "logprobs": 1, "max_tokens": 30, "stop": ["zzz", "qq"]},
    ],
    ids=["echo", "stop_strings"],
)
def test_streamed_logprobs_equal_the_whole_response(http, body):
    body = body | {"temperature": 0, "ignore_eos": True}
    whole = complete(http, **body)["choices"][0]
    text, merged = streamed_logprobs(http, body)
    assert text == whole["text"]
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"])
    assert len(set(merged["text_offset"])) == len(merged["text_offset"]) > 5


def test_vllm_prompt_logprobs_field(http, hf_tiny):
    out = complete(http, prompt=PROMPT_IDS, prompt_logprobs=2, max_tokens=2, temperature=0)
    choice = out["choices"][0]
    assert choice["logprobs"] is None  # generation logprobs were not asked for
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(PROMPT_IDS) and scored[0] is None
    expected = hf_logprobs(hf_tiny, PROMPT_IDS)
    for position in range(1, len(PROMPT_IDS)):
        want = expected[position - 1]
        entry = scored[position]
        token = PROMPT_IDS[position]
        assert next(iter(entry)) == str(token)
        best = want.topk(2).indices.tolist()
        assert set(entry) == {str(token), *map(str, best)}
        for token_id, item in entry.items():
            assert set(item) == {"logprob", "rank", "decoded_token"}
            assert item["logprob"] == pytest.approx(want[int(token_id)].item(), abs=1e-4)
            assert item["rank"] == int((want > want[int(token_id)]).sum()) + 1
    # Streamed, the first chunk carries them; the others do not.
    _, events = read_events(
        http,
        {"model": MODEL_NAME, "prompt": PROMPT_IDS, "prompt_logprobs": 2, "max_tokens": 3,
         "temperature": 0, "stream": True},
    )  # fmt: skip
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]
    assert chunks[0]["prompt_logprobs"] == scored
    assert all(c["prompt_logprobs"] is None for c in chunks[1:])


def test_prompt_logprobs_must_agree_with_echoed_logprobs(http):
    body = {"model": MODEL_NAME, "prompt": "x y", "echo": True, "logprobs": 1, "prompt_logprobs": 3}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


def test_continuous_usage_stats_count_each_choice(http):
    body = {
        "model": MODEL_NAME, "prompt": "Lists are", "max_tokens": 5, "n": 2, "seed": 3,
        "ignore_eos": True, "stream": True, "logprobs": 0,  # logprobs: tokens per chunk
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    _, events = read_events(http, body)
    *deltas, final = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    tokens: dict[int, int] = {}
    for chunk in deltas:
        choice = chunk["choices"][0]
        tokens[choice["index"]] = tokens.get(choice["index"], 0) + len(choice["logprobs"]["tokens"])
        usage = chunk["usage"]
        assert usage["completion_tokens"] == tokens[choice["index"]]
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert tokens == {0: 5, 1: 5}
    assert final["usage"]["completion_tokens"] == 10
