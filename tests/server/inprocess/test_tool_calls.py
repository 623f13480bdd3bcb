"""Tool calling on /v1/chat/completions through the official openai client and raw HTTP: forced
calls (a named function, "required", one or parallel) on any model, their arguments valid
against the tool's schema, plain and streamed (the deltas concatenate to the response's
calls); "none"; "auto" with the hermes parser; a conversation that returns a tool result,
rendered as transformers renders it; bad tools and tool_choice refused by name."""

import json

import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from octavo.engine import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, TOOL_CHAT_TEMPLATE

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A forecast.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def create(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=kwargs.pop("messages", MESSAGES), **kwargs
    )


def assert_valid_calls(calls, names=None) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(client: openai.OpenAI, **kwargs) -> tuple[dict, list]:
    """Per choice: (content, [(id, name, arguments)]) from the deltas; and the finish reasons."""
    choices: dict[int, dict] = {}
    reasons = []
    for chunk in create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"content": "", "calls": {}})
            state["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in state["calls"]  # id and name come once, first
                    state["calls"][call.index] = [call.id, call.function.name, ""]
                else:
                    assert call.function.name is None
                state["calls"][call.index][2] += call.function.arguments or ""
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return choices, reasons


def test_a_named_function_is_called_with_valid_arguments(tools_client):
    response = create(tools_client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=64)
    [choice] = response.choices
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid_calls([call])
    assert choice.finish_reason == "tool_calls"
    # Streamed: the same call, as OpenAI's deltas (id and name first, then fragments).
    choices, reasons = streamed_calls(
        tools_client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=64
    )
    [(call_id, name, arguments)] = choices[0]["calls"].values()
    assert call_id.startswith("call_") and name == "get_weather"
    assert arguments == call.function.arguments and choices[0]["content"] == ""
    assert reasons == ["tool_calls"]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_chooses_among_the_tools(tools_client, parallel):
    """Eight sampled choices: each calls the tools with valid arguments; one call each
    without parallel_tool_calls, and with it some choice makes several (a choice may then
    run to max_tokens, its last call cut)."""
    response = create(
        tools_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        n=8, temperature=1.0, seed=3, max_tokens=140,
    )  # fmt: skip
    counts = []
    for choice in response.choices:
        assert choice.message.content is None
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":  # parallel calls may run past max_tokens
            assert parallel
            calls = calls[:-1]  # the last call's arguments are cut
        else:
            assert choice.finish_reason == "tool_calls"
            counts.append(len(calls))
        assert_valid_calls(calls, names=SCHEMAS)
    assert len(counts) >= 4 and min(counts) >= 1
    if parallel:
        assert max(counts) > 1
    else:
        assert set(counts) == {1}
    # Streamed with the same seed: the same calls, index by index.
    choices, reasons = streamed_calls(
        tools_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        n=8, temperature=1.0, seed=3, max_tokens=140,
    )  # fmt: skip
    assert sorted(reasons) == sorted(c.finish_reason for c in response.choices)
    for choice in response.choices:
        got = [(name, arguments) for _, name, arguments in choices[choice.index]["calls"].values()]
        assert got == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_none_answers_in_text(tools_client):
    response = create(tools_client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    [choice] = response.choices
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_a_forced_call_cut_by_max_tokens_ends_with_length(tools_client):
    response = create(tools_client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=3)
    [choice] = response.choices
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments and '"days"' not in call.function.arguments  # partial


HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_finds_hermes_calls_in_the_text(tools_client, stream):
    """The model's text is forced (a regex) to some words and a hermes call: "auto" answers
    the words as content and the block as a call, streamed or not."""
    body = {
        "tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 140,
        "extra_body": {"structured_outputs": {"regex": "Sure\\. " + _regex_escape(HERMES_CALL)}},
    }  # fmt: skip
    if stream:
        choices, reasons = streamed_calls(tools_client, **body)
        content = choices[0]["content"]
        calls = [(name, args) for _, name, args in choices[0]["calls"].values()]
        assert reasons == ["tool_calls"]
    else:
        [choice] = create(tools_client, **body).choices
        content = choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls"
    assert content == "Sure. "
    assert calls == [("add", '{"a": 2, "b": 40}')]


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text).replace("\n", "\\n")


def test_auto_needs_the_servers_flags(client):
    with pytest.raises(openai.BadRequestError) as error:
        create(client, tools=TOOLS, max_tokens=4)  # tool_choice defaults to "auto"
    assert error.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in error.value.body["message"]
    # Forced calls need no flag and no tool-aware template.
    response = create(client, tools=TOOLS, tool_choice="required", max_tokens=140, temperature=0)
    assert_valid_calls(response.choices[0].message.tool_calls, names=SCHEMAS)


def test_a_conversation_returning_a_tool_result(tools_client, tiny_model_dir):
    """The model's call goes back as an assistant message with tool_calls, its result as a
    tool message: the prompt is transformers' rendering of the same conversation and tools
    (arguments as a dict, as templates read them), completed as the offline engine does."""
    first = create(tools_client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    second = create(
        tools_client, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=4,
    )  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model_dir}/tokenizer.json")
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    rendered_call = {**call.model_dump(), "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}  # fmt: skip
    hf_messages = [messages[0], {**messages[1], "tool_calls": [rendered_call]}, messages[2]]
    text = tokenizer.apply_chat_template(
        hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text and "get_weather add" in text
    prompt = tokenizer.encode(text, add_special_tokens=False)
    offline = LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=64)
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0].outputs[0]
    assert second.usage.prompt_tokens == len(prompt)
    assert second.choices[0].message.content == expected.text


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                      {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(tools_server, change, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4} | change
    response = tools_server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_tools_leave_no_request_running(tools_server):
    """A forced stream the client leaves after its first event, then a good request: the
    engine is whole."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "stream": True, "max_tokens": 140}  # fmt: skip
    with tools_server.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    ok = tools_server.http.post(
        "/v1/chat/completions", json=body | {"stream": False, "max_tokens": 50}
    )
    assert ok.status_code == 200
    assert isinstance(ok.json()["choices"][0]["message"]["tool_calls"], list)


def test_tool_calls_over_raw_http_have_openais_shape(tools_server):
    response = tools_server.http.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
              "max_tokens": 64, "temperature": 0},
    )  # fmt: skip
    message = response.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    assert set(call) == {"id", "type", "function"} and set(call["function"]) == {
        "name", "arguments"}  # fmt: skip
