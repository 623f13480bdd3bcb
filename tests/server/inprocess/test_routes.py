"""Every route of the app, in-process, each against an oracle: greedy text is the offline
`LLM.generate` text, a stream's deltas concatenate to the unstreamed response, chat is the
completion of the conversation as transformers renders it, token ids are the tokenizers
library's, model cards the checkpoint's config."""

import json
import time
from pathlib import Path

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from octavo.engine import LLM, SamplingParams
from tests.server.conftest import CHAT_TEMPLATE, MODEL_NAME
from tests.sse import parse_sse

PROMPT = "The for statement"
MESSAGES = [
    {"role": "system", "content": "You answer in Python."},
    {"role": "user", "content": "Define a class."},
]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", num_blocks=256, block_size=8)


def greedy(offline: LLM, prompt: str | list[int], max_tokens: int, **params):
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    return offline.generate(prompt, sampling, use_tqdm=False)[0].outputs[0]


def events(response) -> list[dict]:
    """A 200 SSE response's JSON events, checked to end with [DONE]."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, done = parse_sse(response.content)
    assert done == "[DONE]"
    return [json.loads(chunk) for chunk in chunks]


def test_health(http):
    response = http.get("/health")
    assert response.status_code == 200 and response.content == b""


def test_a_greedy_completion_is_the_offline_generation(http, offline, tiny_model_dir):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    expected = greedy(offline, PROMPT, 12)
    (choice,) = out["choices"]
    assert choice["text"] == expected.text and choice["index"] == 0
    assert choice["finish_reason"] == expected.finish_reason
    assert out["object"] == "text_completion" and out["model"] == MODEL_NAME
    assert out["id"].startswith("cmpl-") and out["created"] > 0
    oracle = tokenizers.Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    prompt_tokens = len(oracle.encode(PROMPT).ids)
    usage = out["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == len(expected.token_ids)
    assert usage["total_tokens"] == prompt_tokens + len(expected.token_ids)


def test_a_stream_concatenates_to_the_unstreamed_completion(http, offline):
    body = {"model": MODEL_NAME, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    whole = http.post("/v1/completions", json=body).json()
    chunks = events(
        http.post(
            "/v1/completions",
            json=body | {"stream": True, "stream_options": {"include_usage": True}},
        )
    )
    *deltas, usage = chunks
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in deltas:
        assert chunk["id"] == chunks[0]["id"] and chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert choice["index"] not in finishes, "an event after the choice finished"
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert texts == {i: greedy(offline, p, 10, ignore_eos=True).text
                     for i, p in enumerate(body["prompt"])}  # fmt: skip
    assert finishes == {0: "length", 1: "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] == 5


@pytest.fixture(scope="module")
def chat_prompt(tiny_model_dir) -> list[int]:
    """transformers' rendering and tokenization of MESSAGES with the server's template."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model_dir}/tokenizer.json")
    tokenizer.chat_template = CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_is_the_completion_of_the_rendered_conversation(http, offline, chat_prompt):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    out = http.post("/v1/chat/completions", json=body).json()
    expected = greedy(offline, chat_prompt, 10)
    (choice,) = out["choices"]
    assert out["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": expected.text} | {
        k: v for k, v in choice["message"].items() if k not in ("role", "content")
    }
    assert choice["finish_reason"] == expected.finish_reason
    assert out["usage"]["prompt_tokens"] == len(chat_prompt)
    assert out["usage"]["completion_tokens"] == len(expected.token_ids)
    chunks = events(http.post("/v1/chat/completions", json=body | {"stream": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == expected.finish_reason


def test_models_are_the_checkpoints_card(http, tiny_model_dir):
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == tiny_model_dir
    assert card["max_model_len"] == config["n_positions"]
    one = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert {k: v for k, v in one.items() if k != "permission"} == {
        k: v for k, v in card.items() if k != "permission"
    }
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_models_card_says_the_same_created_time_on_every_request(http, monkeypatch):
    first = http.get(f"/v1/models/{MODEL_NAME}").json()
    an_hour_later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: an_hour_later)
    again = http.get(f"/v1/models/{MODEL_NAME}").json()
    (listed,) = http.get("/v1/models").json()["data"]
    assert again["created"] == listed["created"] == first["created"]


def test_tokenize_is_the_tokenizer_and_detokenize_inverts_it(http, tiny_model_dir):
    text = "The café menu, twice: café!"
    oracle = tokenizers.Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    response = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text})
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["tokens"] == oracle.encode(text).ids and out["count"] == len(out["tokens"])
    assert out["token_strs"] is None and out["max_model_len"] == config["n_positions"]
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # The token ids are the ones a completion of the same text is counted with.
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 1}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 10_000]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, "top_p"),
        ("/tokenize", {"prompt": 5}, "prompt"),
    ],
)
def test_a_bad_field_is_an_openai_shaped_400_naming_it(http, path, body, param):
    response = http.post(path, json={"model": MODEL_NAME} | body)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    assert response.json()["error"]["message"]
