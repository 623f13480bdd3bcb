"""Prefix caching seen from the API: usage.prompt_tokens_details.cached_tokens (OpenAI's
field) and the octavo:prefix_cache_* counters (vLLM's), streamed and not (the app in-process)."""

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import ENGINE_ARGS

BLOCK_SIZE = ENGINE_ARGS["block_size"]
# 40 token ids: 4 full blocks, plus the last token's to compute.
PROMPT = [(7 * i) % 500 + 1 for i in range(41)]


def test_a_repeated_prompt_reports_its_cached_tokens(app_server, client):
    before = app_server.metrics()
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    # Full blocks only, and never the last prompt token: 5 blocks hold 40 of the 41 tokens.
    assert again.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 5 * BLOCK_SIZE)
    after = app_server.metrics()
    queries = "octavo:prefix_cache_queries_total"
    hits = "octavo:prefix_cache_hits_total"
    assert after[queries] - before[queries] == 2 * len(PROMPT)
    assert after[hits] - before[hits] >= 5 * BLOCK_SIZE
    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=[PROMPT, PROMPT[:17]],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # Both prompts hit: 40 tokens, and 16 of the 17-token prefix.
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 40 + 16
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x" * 60}], max_tokens=1
    )
    chat_again = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x" * 60}], max_tokens=1
    )
    assert chat.usage.prompt_tokens_details.cached_tokens <= (
        chat_again.usage.prompt_tokens_details.cached_tokens
    )
    assert chat_again.usage.prompt_tokens_details.cached_tokens > 0
