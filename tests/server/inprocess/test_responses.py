"""/v1/responses (stateless) through the official openai client and raw HTTP, the app
in-process: a request is the chat request of the same conversation (its text is the offline
engine's completion of the conversation as transformers renders it, and the chat endpoint's
answer); structured outputs and function tools (forced, "required", hermes "auto") give
output items the openai client parses; a conversation returning a call's output goes on;
streams send the Responses events in order, their deltas concatenating to the final
response; bad requests are a 400 naming the Responses field, and no request, however odd,
gets a 5xx; a stream left early leaves the engine whole."""

import asyncio
import json
from types import SimpleNamespace
from typing import get_args

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from transformers import PreTrainedTokenizerFast

from octavo.engine import LLM, SamplingParams
from octavo.engine.frontend.async_engine import EngineStoppedError
from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.errors import APIError
from octavo.server.responses_protocol import ResponsesRequest
from octavo.server.serving_engine import Generation, ServerConfig
from octavo.server.serving_responses import ResponsesServing, ResponseStream
from tests.server.conftest import CHAT_TEMPLATE, MODEL_NAME
from tests.server.inprocess.test_fuzz import (
    ANYTHING,
    EXTREMES,
    FUZZ_SETTINGS,
    PARAMETERS,
    TOOL_NAME,
    encode,
    post_raw,
)
from tests.server.inprocess.test_tool_calls import ADD, WEATHER
from tests.server.test_load_and_disconnect import wait_for_idle

INSTRUCTIONS = "You answer in Python."
QUESTION = "Define a class."
# The conversation of INSTRUCTIONS and QUESTION, as a chat request sends it.
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
# The Responses API's tools are flat: no "function" object around name and parameters.
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "A forecast.",
     "parameters": WEATHER},
    {"type": "function", "name": "add", "parameters": ADD},
]  # fmt: skip
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    for tool in TOOLS
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMED = {"type": "function", "name": "get_weather"}
# Each stream event's type -> the openai client's model of it.
EVENT_MODELS = {
    model.model_fields["type"].annotation.__args__[0]: model
    for model in get_args(get_args(ResponseStreamEvent)[0])
}


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model_dir}/tokenizer.json")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sse_events(body: bytes) -> list[dict]:
    """A Responses stream's events: each `event: <type>` and `data: <JSON>` of that type,
    and no [DONE]; each checked against the openai client's model of its type."""
    events = []
    for block in body.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENT_MODELS[event["type"]].model_validate(event)
        events.append(event)
    assert body.endswith(b"\n\n")
    return events


def runs(types: list[str]) -> list[str]:
    """Event types with each run of one type counted once."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def assert_valid_calls(output) -> None:
    """Each item a completed call of one of TOOLS, its arguments valid against its schema."""
    for item in output:
        assert item.type == "function_call" and item.status == "completed"
        assert item.id.startswith("fc_") and item.call_id.startswith("call_")
        assert item.name in SCHEMAS
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


def test_a_greedy_response_is_the_chat_completion_of_the_conversation(
    app_server, client, offline, hf_tokenizer
):
    """instructions and a string input are the system and user messages: the text is the
    offline completion of transformers' rendering, and chat's; the usage counts are chat's.
    The raw body is the openai client's Response, validated."""
    got = client.responses.create(
        model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8,
        temperature=0,
    )  # fmt: skip
    text = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = hf_tokenizer.encode(text, add_special_tokens=False)
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert got.output_text == expected.text == chat.choices[0].message.content
    assert got.object == "response" and got.id.startswith("resp_") and got.model == MODEL_NAME
    assert got.usage.input_tokens == len(prompt) == chat.usage.prompt_tokens
    assert got.usage.output_tokens == len(expected.token_ids) == chat.usage.completion_tokens
    assert got.usage.total_tokens == chat.usage.total_tokens
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    [message] = got.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    if expected.finish_reason == "length":
        assert got.status == message.status == "incomplete"
        assert got.incomplete_details.reason == "max_output_tokens"
    else:
        assert got.status == message.status == "completed" and got.incomplete_details is None
    # The settings are echoed; nothing is stored.
    assert got.instructions == INSTRUCTIONS and got.max_output_tokens == 8
    assert got.temperature == 0 and got.top_p == 1 and got.tool_choice == "auto"
    assert got.tools == [] and got.text.format.type == "text" and got.store is False
    raw = app_server.http.post(
        "/v1/responses",
        json={"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 2, "store": True,
              "metadata": {"k": "v"}, "truncation": "disabled"},
    )  # fmt: skip
    assert raw.status_code == 200, raw.text
    parsed = Response.model_validate(raw.json())
    assert parsed.store is False and parsed.metadata == {"k": "v"}
    assert parsed.usage.output_tokens == 2


def test_input_items_with_a_json_schema_format(client):
    """Messages as items (text parts, an assistant's output_text sent back) and
    text.format json_schema: the text validates, and is chat's under response_format."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                       "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "count"],
        "additionalProperties": False,
    }  # fmt: skip
    items = [
        {"role": "user", "content": "Is it?"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Maybe.", "annotations": []}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer in"},
                                          {"type": "input_text", "text": "JSON."}]},
    ]  # fmt: skip
    text_format = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    got = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", input=items,
        text={"format": text_format}, max_output_tokens=100, temperature=0,
    )  # fmt: skip
    assert got.status == "completed", got
    jsonschema.validate(json.loads(got.output_text), schema)
    assert got.text.format.type == "json_schema" and got.text.format.name == "x"
    messages = [
        {"role": "system", "content": "Be brief."},
        items[0],
        {"role": "assistant", "content": "Maybe."},
        {"role": "developer", "content": "Answer in\nJSON."},
    ]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    assert got.output_text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens


def test_json_object_format_and_continuing_an_assistant_message(client):
    got = client.responses.create(
        model=MODEL_NAME, input="JSON?", text={"format": {"type": "json_object"}},
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    if got.status == "completed":
        assert isinstance(json.loads(got.output_text), dict)
    else:
        assert got.output_text.startswith("{")
    # A last assistant message still in progress is continued, as vLLM does it.
    partial = {"role": "assistant", "content": "x = [", "status": "in_progress"}
    continued = client.responses.create(
        model=MODEL_NAME, input=[{"role": "user", "content": QUESTION}, partial],
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}, partial],
        max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    assert continued.output_text == chat.choices[0].message.content


def test_a_named_function_and_required_calls(tools_client):
    named = tools_client.responses.create(
        model=MODEL_NAME, input="Weather?", tools=TOOLS, tool_choice=NAMED,
        max_output_tokens=64, temperature=0,
    )  # fmt: skip
    [call] = named.output
    assert call.name == "get_weather" and named.output_text == ""
    assert_valid_calls(named.output)
    assert named.status == "completed" and named.tool_choice.name == "get_weather"
    assert [tool.name for tool in named.tools] == ["get_weather", "add"]
    # The chat request of the same tools and choice makes the same call.
    chat = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}], tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    for parallel in (False, True):
        required = tools_client.responses.create(
            model=MODEL_NAME, input="Weather?", tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, max_output_tokens=140, temperature=1.0,
            extra_body={"seed": 3},
        )  # fmt: skip
        assert required.parallel_tool_calls is parallel
        if required.status == "incomplete":  # parallel calls may run past the limit
            assert parallel and required.output[-1].status == "incomplete"
            assert_valid_calls(required.output[:-1])
        else:
            assert_valid_calls(required.output)
            assert parallel or len(required.output) == 1


def test_a_conversation_returning_a_function_calls_output(tools_client):
    """The call goes back as its function_call item (as the client parsed it), its result as
    a function_call_output item: the answer is chat's to the same conversation."""
    first = tools_client.responses.create(
        model=MODEL_NAME, input="Weather?", tools=TOOLS, tool_choice=NAMED,
        max_output_tokens=64, temperature=0,
    )  # fmt: skip
    [call] = first.output
    items = [
        {"role": "user", "content": "Weather?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    second = tools_client.responses.create(
        model=MODEL_NAME, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert second.output_text and second.output[0].type == "message"
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    chat = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=CHAT_TOOLS, tool_choice="none", max_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text).replace("\n", "\\n")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_gives_a_message_then_a_function_call(tools_client, stream):
    """The text is forced (a regex) to some words and a hermes call: "auto" answers them as
    a message item and a function_call item, streamed or not."""
    body = dict(
        model=MODEL_NAME, input="Add.", tools=TOOLS, max_output_tokens=140, temperature=0,
        extra_body={"structured_outputs": {"regex": "Sure\\. " + _regex_escape(HERMES_CALL)}},
    )  # fmt: skip
    if stream:
        with tools_client.responses.stream(**body) as events:
            got = events.get_final_response()
    else:
        got = tools_client.responses.create(**body)
    message, call = got.output
    assert message.type == "message" and got.output_text == "Sure. "
    assert (call.name, call.arguments) == ("add", '{"a": 2, "b": 40}')
    assert got.status == "completed" and got.tool_choice == "auto"


def test_a_stream_sends_the_responses_events_in_order(app_server, client):
    common = dict(
        model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    full = client.responses.create(**common)
    raw = app_server.http.post("/v1/responses", json=common | {"stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{full.status}",
    ]  # fmt: skip
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in deltas)
    text = "".join(e["delta"] for e in deltas)
    assert text == full.output_text == events[-3]["part"]["text"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == text and final.id == events[0]["response"]["id"]
    assert final.status == full.status and final.output[0].id == item_id
    assert final.usage.output_tokens == full.usage.output_tokens == 12
    assert final.usage.input_tokens == full.usage.input_tokens
    # The openai client reads the same stream, typed (the deltas as the engine's outputs
    # came, which timing may group differently).
    streamed = list(client.responses.create(**common, stream=True))
    assert runs([event.type for event in streamed]) == runs(types)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == text


def test_a_streamed_function_call(tools_client):
    body = dict(
        model=MODEL_NAME, input="Weather?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=140, temperature=0,
    )  # fmt: skip
    full = tools_client.responses.create(**body)
    events = list(tools_client.responses.create(**body, stream=True))
    types = [event.type for event in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    [call] = full.output
    assert events[2].item.name == call.name and events[2].item.arguments == ""
    assert "".join(deltas) == events[-3].arguments == call.arguments
    [streamed] = events[-1].response.output
    assert (streamed.name, streamed.arguments, streamed.status) == (
        call.name, call.arguments, "completed")  # fmt: skip
    assert_valid_calls([streamed])


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "none"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "absent"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),  # "auto" without a tool-call parser
        ({"max_output_tokens": 1000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"input": "a\ud800"}, "input"),
        ({"instructions": 3}, "instructions"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "no-such-type"}}}},
         "text"),
        ({"text": {"format": {"type": "json_object"}}, "tools": TOOLS, "tool_choice": NAMED},
         "tools"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"temperature": -1}, "temperature"),
        ({"stream": "yes"}, "stream"),
    ],
)  # fmt: skip
def test_bad_requests_are_a_400_naming_the_field(http, change, param):
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 4} | change
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    response = http.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    # The message names the field as the client sent it.
    assert "max_tokens" not in error["message"] and "response_format" not in error["message"]


def test_an_unknown_model_is_404(http):
    response = http.post("/v1/responses", json={"model": "gpt-4o", "input": QUESTION})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_a_model_without_a_template_answers_400_naming_the_flag():
    engine = SimpleNamespace(tokenizer=None, max_model_len=64)
    serving = ResponsesServing(engine, ServerConfig(served_model_name="m"), metrics=None)  # type: ignore[arg-type]
    request = ResponsesRequest.model_validate({"model": "m", "input": QUESTION})
    with pytest.raises(APIError) as raised:
        asyncio.run(serving.create_responses(request, raw_request=None))  # type: ignore[arg-type]
    assert raised.value.status == 400 and "--chat-template" in raised.value.message


def _stream_of(outputs) -> list[dict]:
    """The events of a stream of `outputs` (engine outputs, or an exception), served by a
    ResponsesServing without an engine."""
    engine = SimpleNamespace(tokenizer=None, max_model_len=64)
    serving = ResponsesServing(engine, ServerConfig(served_model_name="m"), metrics=None)  # type: ignore[arg-type]
    request = ResponsesRequest.model_validate({"model": "m", "input": QUESTION, "stream": True})
    prompts = [(SimpleNamespace(token_ids=[1, 2, 3]), None)]

    async def read() -> bytes:
        stream = ResponseStream(serving, Generation(request, "resp_1", 0, prompts))  # type: ignore[arg-type]
        return b"".join([chunk async for chunk in stream.events(outputs())])

    return sse_events(asyncio.run(read()))


def _output(text: str, finish_reason: str | None) -> tuple[int, RequestOutput]:
    completion = CompletionOutput(0, text, [7], None, None, finish_reason)
    return 0, RequestOutput("r", None, [1, 2, 3], [completion], finish_reason is not None)


def test_an_engine_failure_ends_the_stream_with_response_failed():
    """An exception from the outputs (the engine stopped) ends the stream with an error
    event and response.failed, the message it cut short incomplete; the openai client's
    models read them."""

    async def stopped():
        yield _output("Hel", None)
        raise EngineStoppedError("the engine is shutting down")

    events = _stream_of(stopped)
    assert runs([e["type"] for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "error", "response.failed",
    ]  # fmt: skip
    assert events[-2]["code"] == "service_unavailable_error"
    assert events[-2]["message"] == "the engine is shutting down"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output_text == "Hel" and failed.output[0].status == "incomplete"


def test_an_aborted_output_is_a_failed_response():
    """An output the engine aborted (finish_reason "abort": a shutdown past its grace) ends
    the response as failed, its usage counted."""

    async def aborted():
        yield _output("Hel", None)
        yield _output("lo", "abort")

    events = _stream_of(aborted)
    assert events[-1]["type"] == "response.failed"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.error.code == "server_error" and failed.output_text == "Hello"
    assert failed.output[0].status == "incomplete"
    assert (failed.usage.input_tokens, failed.usage.output_tokens) == (3, 2)


async def _leave_after_first_delta(app, body: dict) -> list[bytes]:
    """Streams `body` through the ASGI app and disconnects once a text delta has arrived
    (a client that leaves); the bytes it got."""
    received: list[bytes] = []
    delta = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await delta.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            received.append(message["body"])
            if b"response.output_text.delta" in message["body"]:
                delta.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/responses", "raw_path": b"/v1/responses",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
        "server": ("octavo.test", 80),
        "headers": [(b"host", b"octavo.test"), (b"content-type", b"application/json")],
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return received


def test_a_stream_left_early_leaves_the_engine_whole(app_server, client):
    """The client leaves after the first delta of a long response: its request is aborted
    (far fewer tokens are generated than asked for), every KV block is freed, and the next
    request is answered."""
    before = app_server.metrics()["octavo:generation_tokens_total"]
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    received = app_server.run(_leave_after_first_delta(app_server.app, body))
    assert b"response.created" in received[0] and b"response.completed" not in b"".join(received)
    metrics = wait_for_idle(app_server, timeout=5.0)
    assert metrics["octavo:num_requests_running"] == 0
    assert metrics["octavo:kv_cache_usage_perc"] == 0
    assert metrics["octavo:generation_tokens_total"] - before < 200
    after = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3)
    assert after.usage.output_tokens == 3


RESPONSES_FIELDS = [
    "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text",
    "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "truncation", "user",
    "seed", "top_k", "stop", "repetition_penalty", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "logit_bias", "structured_outputs", "previous_response_id",
    "include", "reasoning", "background", "made_up_field",
]  # fmt: skip
# Input items near the valid ones: any item type, role and content, a call's fields.
ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output",
                                 "reasoning"]),
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
        "content": st.one_of(ANYTHING, st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
             "text": ANYTHING}), max_size=2)),
        "status": st.sampled_from(["in_progress", "completed", "incomplete"]),
        "call_id": ANYTHING, "name": TOOL_NAME, "arguments": ANYTHING, "output": ANYTHING,
    },
)  # fmt: skip
FLAT_TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search"])},
    optional={"name": TOOL_NAME, "parameters": PARAMETERS, "strict": ANYTHING},
)
RESPONSES_VALUES = st.one_of(
    ANYTHING,
    st.lists(st.one_of(ITEM, ANYTHING), max_size=3),
    st.lists(FLAT_TOOL, max_size=3),
    st.sampled_from(["none", "auto", "required", "disabled"]),
    st.fixed_dictionaries({"type": st.just("function"), "name": TOOL_NAME}),
    st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"name": TOOL_NAME, "schema": PARAMETERS})}),
)  # fmt: skip
SMALL = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3}


def check_answer(response: httpx.Response, changes: dict) -> None:
    """A 200 that ended normally (streamed: its last event response.completed or
    response.incomplete, and no error), or an OpenAI-shaped 4xx; never a 5xx."""
    assert response.status_code < 500, (changes, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(response.content)
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), changes
        assert all(e["type"] != "error" for e in events), changes
    else:
        assert Response.model_validate(response.json()).status in ("completed", "incomplete")


@settings(max_examples=100, **FUZZ_SETTINGS)
@given(
    changes=st.dictionaries(
        st.sampled_from(RESPONSES_FIELDS), RESPONSES_VALUES, min_size=1, max_size=4
    )
)
def test_no_responses_request_gets_a_server_error(http, changes):
    check_answer(post_raw(http, "/v1/responses", encode(SMALL | changes)), changes)


def test_every_field_takes_every_extreme_value_without_a_server_error(app_server, http):
    for field in RESPONSES_FIELDS:
        for value in EXTREMES:
            changes = {field: value}
            check_answer(post_raw(http, "/v1/responses", encode(SMALL | changes)), changes)
    metrics = wait_for_idle(app_server, timeout=5.0)
    assert metrics["octavo:num_requests_running"] == 0, metrics
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
