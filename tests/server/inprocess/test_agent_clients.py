"""Tool calling as the agent libraries use it, against the app in process: LangChain's
`bind_tools(..., tool_choice=...)` and `with_structured_output(method="function_calling")`,
and instructor in its default mode (TOOLS). Each gets valid arguments on the tiny model,
since a forced call is generated under the tool's schema."""

from typing import Literal

import instructor
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import BASE_URL


class GetWeather(BaseModel):
    """The forecast for a city."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


class Add(BaseModel):
    """The sum of two numbers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def chat_model(app_server) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL_NAME, base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0,
        http_client=app_server.http, temperature=0, max_tokens=100,
    )  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["GetWeather", "required", "any"])
def test_langchain_bind_tools(chat_model, tool_choice):
    """A named tool, "required", and LangChain's "any" (sent as "required")."""
    message = chat_model.bind_tools([GetWeather, Add], tool_choice=tool_choice).invoke("Weather?")
    assert message.tool_calls
    for call in message.tool_calls:
        assert call["id"].startswith("call_")
        model = {"GetWeather": GetWeather, "Add": Add}[call["name"]]
        model.model_validate(call["args"])  # the arguments follow the schema
    if tool_choice == "GetWeather":
        assert [call["name"] for call in message.tool_calls] == ["GetWeather"]


def test_langchain_structured_output_by_function_calling(chat_model):
    forecast = chat_model.with_structured_output(GetWeather, method="function_calling").invoke(
        "Weather in Oslo?"
    )
    assert isinstance(forecast, GetWeather)


def test_langchain_streams_a_tool_call(chat_model):
    """Streamed chunks merge into the call the plain response makes (temperature 0)."""
    bound = chat_model.bind_tools([GetWeather], tool_choice="GetWeather")
    merged = None
    for chunk in bound.stream("Weather?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    [streamed] = merged.tool_calls
    [plain] = bound.invoke("Weather?").tool_calls
    assert (streamed["name"], streamed["args"]) == (plain["name"], plain["args"])


def test_instructor_in_its_default_mode(app_server):
    client = instructor.from_openai(app_server.openai())
    assert client.mode == instructor.Mode.TOOLS
    forecast = client.chat.completions.create(
        model=MODEL_NAME, response_model=GetWeather, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Weather?"}], max_retries=0,
    )  # fmt: skip
    assert isinstance(forecast, GetWeather)
