"""/v1/chat/completions through the official openai client and raw HTTP, the app in-process:
the conversation is rendered as transformers' apply_chat_template renders it (the oracle), then
completed exactly as the offline engine completes that prompt."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from octavo.engine import LLM, SamplingParams
from octavo.server.chat_protocol import ChatCompletionRequest
from octavo.server.errors import APIError
from octavo.server.serving_chat import ChatServing
from octavo.server.serving_engine import ServerConfig
from tests.server.conftest import CHAT_TEMPLATE, MODEL_NAME
from tests.server.test_load_and_disconnect import wait_for_idle

PARTS = [{"type": "text", "text": "Now a"}, {"type": "text", "text": "lis"}]
MESSAGES = [
    {"role": "system", "content": "You answer in Python."},
    {"role": "user", "content": "Define a class."},
    {"role": "assistant", "content": "class A:"},
    {"role": "user", "content": PARTS},
]
# The messages as the template sees them: text parts joined with newlines.
RENDERED_MESSAGES = [*MESSAGES[:3], {"role": "user", "content": "Now a\nlis"}]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model_dir}/tokenizer.json")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def hf_prompt(hf_tokenizer, messages=RENDERED_MESSAGES, **kwargs) -> list[int]:
    """transformers' rendering and tokenization of a conversation."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def post(http: httpx.Client, body: dict) -> httpx.Response:
    return http.post("/v1/chat/completions", json=body)


def test_greedy_chat_is_the_offline_completion_of_the_rendered_conversation(
    client, offline, hf_tokenizer
):
    got = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=16, temperature=0
    )
    prompt = hf_prompt(hf_tokenizer, add_generation_prompt=True)
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )[0].outputs[0]
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.model == MODEL_NAME and got.created > 0
    [choice] = got.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason and choice.logprobs is None
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == len(prompt) + len(expected.token_ids)


def test_streamed_chat_sends_the_role_first_and_concatenates_to_the_response(client):
    common = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=20,  # OpenAI's deprecated name works too
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**common)
    chunks = list(
        client.chat.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    # Each choice's first chunk: the role and empty content, before any token.
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert all(choice.delta.role is None for choice in mine[1:])
        text = full.choices[index].message.content
        assert "".join(choice.delta.content for choice in mine) == text
        assert [choice.finish_reason for choice in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.completion_tokens == 40


def test_chat_logprobs_in_openai_shape(client, offline, hf_tokenizer):
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    expected = offline.generate(
        [hf_prompt(hf_tokenizer, add_generation_prompt=True)],
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    content = got.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids) == 8
    for entry, token, engine in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert entry.token == hf_tokenizer.decode([token])
        assert entry.logprob == pytest.approx(engine[token], abs=1e-5)
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best token
    # The tokens' bytes are the text's, even where a token splits a character (the text has
    # U+FFFD where the bytes are not UTF-8).
    token_bytes = bytes(b for entry in content for b in entry.bytes)
    assert token_bytes.decode(errors="replace") == got.choices[0].message.content


def test_template_variables_and_continuing_the_final_message(http, offline, hf_tokenizer):
    with_preamble = post(
        http,
        {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "max_tokens": 4,
            "chat_template_kwargs": {"preamble": "# Python"},
        },
    ).json()
    assert with_preamble["usage"]["prompt_tokens"] == len(
        hf_prompt(hf_tokenizer, add_generation_prompt=True, preamble="# Python")
    )
    # continue_final_message: the prompt stops where the last message's text stops.
    partial = [*RENDERED_MESSAGES, {"role": "assistant", "content": "x = ["}]
    body = {
        "model": MODEL_NAME,
        "messages": partial,
        "max_tokens": 6,
        "temperature": 0,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    got = post(http, body).json()
    prompt = hf_prompt(hf_tokenizer, partial, continue_final_message=True)
    assert hf_tokenizer.decode(prompt).endswith("<|im_start|>assistant\nx = [")
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )[0].outputs[0]
    assert got["usage"]["prompt_tokens"] == len(prompt)
    assert got["choices"][0]["message"]["content"] == expected.text


def test_chat_takes_the_completion_parameters(http, client):
    """Seeds, stops, n, logit_bias and vLLM's extras mean what they mean for completions."""
    common = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, n=3, seed=7, temperature=1)
    first = client.chat.completions.create(**common)
    again = client.chat.completions.create(**common)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    forced = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        logit_bias={"65": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.usage.completion_tokens == 5
    stopped = post(
        http,
        {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "max_tokens": 5,
            "logit_bias": {"65": 100},
            "stop_token_ids": [65],
        },
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["stop_reason"] == 65
    # The default response format, said explicitly, and an empty tool list ask for nothing.
    plain = {"response_format": {"type": "text"}, "tools": []}
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2} | plain
    assert post(http, body).status_code == 200
    scored = post(
        http, {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 1}
    ).json()
    assert scored["prompt_logprobs"][0] is None
    assert len(scored["prompt_logprobs"]) == scored["usage"]["prompt_tokens"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
        # An assistant's tool_calls: OpenAI's list of function calls, arguments as JSON text.
        ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": CALL}]}, "messages"),
        (
            {
                "messages": [
                    *MESSAGES,
                    {"role": "assistant", "tool_calls": [CALL | {"type": "custom"}]},
                ]
            },
            "messages",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [CALL | {"function": {"name": "f", "arguments": {"x": 1}}}],
                    },
                ]
            },
            "messages",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"preamble": 3}}, "messages"),  # the template raised
        ({"max_completion_tokens": 100000}, "max_completion_tokens"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_field(http, change, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4} | change
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    response = http.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_an_unknown_model_is_404_and_the_server_ends_idle(app_server, http):
    response = post(http, {"model": "gpt-4o", "messages": MESSAGES})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    metrics = wait_for_idle(app_server, timeout=5.0)
    assert metrics["octavo:num_requests_running"] == 0
    assert metrics["octavo:kv_cache_usage_perc"] == 0


def test_a_model_without_a_template_answers_400_naming_the_flag():
    engine = SimpleNamespace(tokenizer=None, max_model_len=64)
    serving = ChatServing(engine, ServerConfig(served_model_name="m"), metrics=None)  # type: ignore[arg-type]
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES})
    with pytest.raises(APIError) as raised:
        asyncio.run(serving.create_chat_completion(request, raw_request=None))  # type: ignore[arg-type]
    assert raised.value.status == 400 and "--chat-template" in raised.value.message
