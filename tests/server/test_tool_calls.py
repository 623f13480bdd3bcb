"""The tool-call parsers on texts cut at every point (streamed deltas concatenate to the whole
text's calls), and the schemas forced calls follow."""

import json
import random

import pytest

from octavo.server.tool_calls import (
    ChatTool,
    ContentOnly,
    HermesCalls,
    NamedCall,
    NamedToolChoice,
    RequiredCalls,
    ToolCallParser,
    forced_schema,
)

REQUIRED_TEXT = (
    '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "when": {"day": [1, 2]}}},'
    ' {"parameters": {"a": 1}, "name": "add"}]'
)
HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    "</tool_call> <tool_call>not json</tool_call> and <tool_c"
)


def streamed(parser: ToolCallParser, parts: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls that a parser's deltas add up to."""
    content, calls = "", {}
    deltas = [parser.feed(part) for part in parts] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls and call.name is not None
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return content, [tuple(c) for c in calls.values()]


def random_cuts(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_required_calls_whole_and_cut_anywhere():
    content, calls = RequiredCalls().parse(REQUIRED_TEXT)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Pa\\"ris}", "when": {"day": [1, 2]}}'),
        ("add", '{"a": 1}'),  # parameters before the name: sent once the name is read
    ]
    whole = [(c.function.name, c.function.arguments) for c in calls]
    for seed in range(200):
        assert streamed(RequiredCalls(), random_cuts(REQUIRED_TEXT, seed)) == ("", whole)
    assert streamed(RequiredCalls(), list(REQUIRED_TEXT)) == ("", whole)  # a char at a time


def test_a_required_text_cut_short_keeps_the_partial_arguments():
    _, calls = RequiredCalls().parse('[{"name": "add", "parameters": {"a": 1, "b"')
    assert [(c.function.name, c.function.arguments) for c in calls] == [("add", '{"a": 1, "b"')]


def test_hermes_calls_whole_and_cut_anywhere():
    content, calls = HermesCalls().parse(HERMES_TEXT)
    # The invalid block and the unfinished tag stay content.
    assert content == "Let me check.  <tool_call>not json</tool_call> and <tool_c"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    whole = (content, [(c.function.name, c.function.arguments) for c in calls])
    for seed in range(200):
        assert streamed(HermesCalls(), random_cuts(HERMES_TEXT, seed)) == whole


def test_hermes_holds_back_only_what_may_open_a_tag():
    parser = HermesCalls()
    assert parser.feed("a <tool").content == "a "
    assert parser.feed("s and").content == "<tools and"


def test_a_named_call_is_its_whole_text():
    assert streamed(NamedCall("f"), ['{"a"', ": 1}"]) == ("", [("f", '{"a": 1}')])


TOOLS = [
    ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
        },
        "$defs": {"d": {"type": "object", "properties": {"e": {}}}},
    }}}),
    ChatTool.model_validate({"type": "function", "function": {"name": "g"}}),
]  # fmt: skip


def test_forced_objects_are_closed_unless_they_say_otherwise():
    schema = forced_schema(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "f"}}), parallel_tool_calls=True)  # fmt: skip
    assert schema is not None
    assert schema["additionalProperties"] is False
    properties = schema["properties"]
    assert properties["a"]["additionalProperties"] is False
    assert properties["open"]["additionalProperties"] is True  # said explicitly: kept
    assert properties["list"]["items"]["additionalProperties"] is False
    assert schema["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in TOOLS[0].function.parameters  # the request unchanged


@pytest.mark.parametrize("parallel", [True, False])
def test_required_allows_the_tools_and_one_call_without_parallel(parallel):
    schema = forced_schema(TOOLS, "required", parallel_tool_calls=parallel)
    assert schema is not None and schema["minItems"] == 1
    assert ("maxItems" in schema) == (not parallel)
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert forced_schema(TOOLS, "auto", True) is None and forced_schema(TOOLS, "none", True) is None


def test_without_tools_the_text_is_the_content_even_empty():
    assert ContentOnly().parse("") == ("", [])
    assert ContentOnly().parse("hi") == ("hi", [])


def test_deeply_nested_json_is_text_not_a_crash():
    """A hermes block or an assistant's arguments nested past Python's recursion limit stay
    text (json recurses once per level)."""
    from octavo.server.chat_protocol import ChatMessage

    deep = "[" * 100_000
    content, calls = HermesCalls().parse(f"<tool_call>{deep}</tool_call>")
    assert calls == [] and content == f"<tool_call>{deep}</tool_call>"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    message = ChatMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [call]}
    )
    assert message.for_template()["tool_calls"][0]["function"]["arguments"] == deep
