"""SSE framing and the streamed chunks: one data line per event, [DONE] last, every chunk
encoded exactly as the pydantic shape of the same response would be, and the streams the
builder makes of the engine's outputs."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from octavo.engine.frontend.async_engine import RequestFailedError
from octavo.engine.frontend.input_processor import ProcessedPrompt
from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.chat_protocol import ChatCompletionRequest
from octavo.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Logprobs,
    PromptLogprob,
    PromptTokensDetails,
    Usage,
)
from octavo.server.serving_chat import ChatServing, ChatStream
from octavo.server.serving_completion import CompletionServing, CompletionStream
from octavo.server.serving_engine import Generation, ServerConfig
from octavo.server.stream_chunks import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChunk,
    CompletionChunkChoice,
)
from octavo.server.streaming import SSE_DONE, EventEncoder
from tests.sse import parse_sse


@pytest.mark.parametrize(
    "text",
    [
        "a\nb",
        "carriage\rreturn",
        "crlf\r\n\r\nblank",
        "\u2028\u2029 separators",
        "data: [DONE]\n\n",
    ],
)
def test_an_event_carries_its_payload_whole_to_an_sse_parser(text):
    """Line breaks in the payload must not end the data line (nor, as a blank line, the
    event): a spec-following parser gets back exactly the payload, one event per call."""
    first = CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text=text)]
    )
    second = first.model_copy(update={"id": "cmpl-2"})
    encoder = EventEncoder()
    events = parse_sse(encoder.event(first) + encoder.event(second, "named") + SSE_DONE)
    assert len(events) == 3
    assert [json.loads(e) for e in events[:2]] == [
        first.model_dump(mode="json"),
        second.model_dump(mode="json"),
    ]
    assert events[2] == "[DONE]"


LOGPROBS = Logprobs(
    tokens=[" a", "é"],
    token_logprobs=[-0.5, None],
    top_logprobs=[{" a": -0.5, " b": -1.5}, None],
    text_offset=[0, 2],
)
PROMPT_LOGPROBS = [None, {"7": PromptLogprob(logprob=-2.0, rank=3, decoded_token="x")}]
USAGE = Usage(
    prompt_tokens=3,
    completion_tokens=2,
    total_tokens=5,
    prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
)


@pytest.mark.parametrize(
    "fields",
    [
        {"text": ' plain "quoted"\n\u2028 text', "finish_reason": None},
        {"text": "", "finish_reason": "stop", "stop_reason": "\n\n"},
        {"text": "x", "finish_reason": "length", "stop_reason": 50256, "logprobs": LOGPROBS},
        {"text": "y", "prompt_logprobs": PROMPT_LOGPROBS},
    ],
)
@pytest.mark.parametrize("usage", [None, USAGE])
def test_a_completion_chunk_encodes_as_the_completion_response_does(fields, usage):
    """The oracle: pydantic's JSON of CompletionResponse, the non-streamed response's model,
    for the same content; a field added to one shape and not the other fails here."""
    choice = CompletionChoice(index=2, **fields)
    expected = CompletionResponse(id="cmpl-9", created=7, model="m", choices=[choice], usage=usage)
    struct_choice = CompletionChunkChoice(index=2, **fields)
    chunk = CompletionChunk(id="cmpl-9", created=7, model="m", choices=[struct_choice], usage=usage)
    event = EventEncoder().event(chunk)
    assert event == b"data: %s\n\n" % expected.model_dump_json().encode()


def test_a_chat_chunk_has_openais_chat_completion_chunk_shape():
    """Against the official openai client's type of a chat stream chunk."""
    from openai.types.chat import ChatCompletionChunk as OpenAIChunk

    chunk = ChatCompletionChunk(
        id="chatcmpl-1",
        created=7,
        model="m",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="hi"), finish_reason="stop")],
        usage=USAGE,
    )
    event = EventEncoder().event(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    data = json.loads(event[len(b"data: ") :])
    parsed = OpenAIChunk.model_validate(data)
    assert parsed.object == "chat.completion.chunk"
    assert parsed.choices[0].delta.content == "hi" and parsed.choices[0].delta.role is None
    assert parsed.usage is not None and parsed.usage.total_tokens == 5
    assert set(data) == {
        "id", "object", "created", "model", "choices", "usage", "system_fingerprint",
        "prompt_logprobs",
    }  # fmt: skip


def _serving(route):
    """A route's serving object without an engine: enough to build its streams."""
    engine = SimpleNamespace(tokenizer=None, max_model_len=64)
    return route(engine, ServerConfig(served_model_name="m"), metrics=None)


def _output(index, text, tokens, finish_reason=None, stop_reason=None, cached=None):
    completion = CompletionOutput(index, text, tokens, None, None, finish_reason, stop_reason)
    return RequestOutput(
        "r-0", None, [1, 2, 3], [completion], finish_reason is not None,
        num_cached_tokens=cached,
    )  # fmt: skip


async def _items(events, outputs):
    """What a stream sends (each item one `send`), its outputs raising what is an exception."""

    async def merged():
        for output in outputs:
            if isinstance(output, Exception):
                raise output
            yield 0, output

    return [item async for item in events(merged())]


def _chunks(item):
    return [json.loads(e) if e != "[DONE]" else e for e in parse_sse(item)]


PROMPTS = [(ProcessedPrompt(None, [1, 2, 3]), None)]


def test_a_completion_stream_sends_each_output_then_usage_then_done():
    """Per output one item of one event for each choice that progressed, with its usage so
    far (continuous_usage_stats); then the whole usage with [DONE], in one item."""
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": [1, 2, 3], "n": 2, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )  # fmt: skip
    stream = CompletionStream(
        _serving(CompletionServing), Generation(request, "cmpl-1", 7, PROMPTS)
    )
    first = _output(0, " a", [7], cached=2)
    first.outputs.append(CompletionOutput(1, " b", [8], None, None))
    outputs = [first, _output(1, " c", [9, 0], "stop", 0), _output(0, "d", [5], "length")]
    items = asyncio.run(_items(stream.events, outputs))
    assert len(items) == 4
    events = [_chunks(item) for item in items]
    assert [len(e) for e in events] == [2, 1, 1, 2] and events[-1][-1] == "[DONE]"
    choices = [chunk["choices"][0] for chunk in sum(events[:3], [])]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, " a", None), (1, " b", None), (1, " c", "stop"), (0, "d", "length"),
    ]  # fmt: skip
    assert [chunk["usage"]["completion_tokens"] for chunk in sum(events[:3], [])] == [1, 1, 3, 2]
    total = events[-1][0]
    assert total["choices"] == [] and total["object"] == "text_completion"
    assert total["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }  # fmt: skip
    assert {(chunk["id"], chunk["created"]) for chunk in sum(events[:3], [])} == {("cmpl-1", 7)}


def test_a_chat_stream_opens_with_each_choices_role_and_ends_an_error_with_done():
    """The roles go first, in one item; an exception from the outputs is an error event and
    [DONE], after the events already sent."""
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
    )
    stream = ChatStream(_serving(ChatServing), Generation(request, "chatcmpl-1", 7, PROMPTS))
    outputs = [_output(1, "x", [4]), RequestFailedError("boom")]
    items = asyncio.run(_items(stream.events, outputs))
    roles, delta, error = (_chunks(item) for item in items)
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    assert delta[0]["object"] == "chat.completion.chunk"
    assert delta[0]["choices"][0]["delta"] == {"role": None, "content": "x"}
    assert error[1] == "[DONE]" and "boom" in error[0]["error"]["message"]
