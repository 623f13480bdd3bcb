"""Clients nobody here wrote, against `octavo serve` with no model, template or tool flag: the
embedded model chats, calls a tool and finishes an agent loop. Greedy (temperature 0), so
every run is the same run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from octavo.server.server_args import DEFAULT_MODEL_NAME
from tests.server.conftest import LiveServer, live_server
from tools.check_agent_loop import FORECAST, run_loop

pytestmark = pytest.mark.slow  # a live server

# The first held-out city: never in a training conversation (tools/chat_corpus.py). The rate
# over all of them is tools/check_agent_loop.py's figure (server/default_model/README.md).
CITY = "Berlin"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory) -> Iterator[LiveServer]:
    with live_server(None, tmp_path_factory.mktemp("default")) as server:
        yield server


@pytest.fixture(scope="module")
def base_url(default_server) -> str:
    return f"{default_server.base_url}/v1"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def get_weather(city: str) -> str:
    """Returns the weather in a city."""
    return FORECAST if city == CITY else "unknown"


def test_models_lists_the_embedded_chat_model(default_server):
    [card] = httpx.get(f"{default_server.base_url}/v1/models", timeout=10).json()["data"]
    assert card["id"] == DEFAULT_MODEL_NAME == "octavo-tiny-chat"
    assert card["root"].endswith("default_model") and card["max_model_len"] == 512


def test_openai_chat_completions_answer_and_stream(client):
    messages = [{"role": "user", "content": "What is the while statement?"}]
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, temperature=0
    )
    [choice] = answer.choices
    assert choice.finish_reason == "stop" and "while" in choice.message.content
    assert not choice.message.tool_calls
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_chat_completions_call_a_tool_on_auto(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Returns the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    }}]  # fmt: skip
    messages = [{"role": "user", "content": f"What is the weather in {CITY}?"}]
    first = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, tools=tools, temperature=0
    )
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": CITY}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": FORECAST}]  # fmt: skip
    second = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, tools=tools, temperature=0
    )
    assert second.choices[0].finish_reason == "stop"
    assert FORECAST in second.choices[0].message.content


def test_openai_responses_create(client):
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="What is the for statement?", temperature=0
    )
    assert response.status == "completed" and "for" in response.output_text


def test_langchain_invoke_and_bind_tools(base_url):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=DEFAULT_MODEL_NAME, base_url=base_url, api_key="unused", temperature=0,
        max_retries=0,
    )  # fmt: skip
    assert model.invoke("What is the if statement?").content
    message = model.bind_tools([tool(get_weather)]).invoke(f"What is the weather in {CITY}?")
    [call] = message.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": CITY})


def test_litellm_completion(base_url, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    response = litellm.completion(
        model=f"openai/{DEFAULT_MODEL_NAME}", api_base=base_url, api_key="unused",
        messages=[{"role": "user", "content": "What is a lambda?"}], temperature=0,
    )  # fmt: skip
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agents_sdk_run_calls_the_tool_and_answers_with_its_result(base_url, api):
    """Runner.run with one function tool, temperature 0 and the SDK's other defaults:
    the model calls the tool, reads its result and answers, within 3 turns."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)  # traces would be exported to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    model = kind(model=DEFAULT_MODEL_NAME, openai_client=client)
    calls, output = asyncio.run(run_loop(model, CITY))
    assert calls == [CITY]
    assert FORECAST in output
