"""The official openai client (sync and async) against the app in-process: its parsing of
every response is the oracle of the response's shape."""

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import BASE_URL

PROMPT = "The return statement"


def test_streaming_concatenates_to_the_non_streaming_text(client):
    full = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert len(chunks) > 3
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_n_samples_with_a_seed_are_distinct_and_reproducible(client):
    def sample():
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=16,
            n=2,
            temperature=1.0,
            seed=42,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first, second = sample(), sample()
    assert first == second and first[0] != first[1]


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert value <= 0 and token in top and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy takes the most likely
    assert "".join(logprobs.tokens) == out.choices[0].text


def test_include_usage_adds_a_final_usage_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_stream_and_not(app_server):
    async def main():
        transport = httpx.ASGITransport(app=app_server.app)
        http_client = httpx.AsyncClient(transport=transport, base_url=BASE_URL)
        client = openai.AsyncOpenAI(
            base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0, http_client=http_client
        )
        plain = await client.completions.create(
            model=MODEL_NAME, prompt=[PROMPT, "Lists"], max_tokens=8, temperature=0
        )
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        texts = [c.choices[0].text async for c in stream]
        await client.close()
        return plain, texts

    plain, texts = app_server.run(main())
    assert [c.index for c in plain.choices] == [0, 1]
    assert "".join(texts) == plain.choices[0].text
