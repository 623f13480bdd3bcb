"""SSE framing and the streamed chunks: one data line per event, [DONE] last, and every chunk
encoded exactly as the pydantic shape of the same response would be."""

import json

import pytest

from octavo.server.protocol import (
    CompletionChoice,
    CompletionResponse,
    Logprobs,
    PromptLogprob,
    PromptTokensDetails,
    Usage,
)
from octavo.server.stream_chunks import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChunk,
    CompletionChunkChoice,
    EventEncoder,
    jsonable,
)
from octavo.server.streaming import SSE_DONE, sse_event
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
    events = parse_sse(sse_event(first) + sse_event(second) + SSE_DONE)
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
    struct_choice = CompletionChunkChoice(
        index=2, **{k: jsonable(v) if k.endswith("logprobs") else v for k, v in fields.items()}
    )
    chunk = CompletionChunk(
        id="cmpl-9", created=7, model="m", choices=[struct_choice], usage=jsonable(usage)
    )
    event = EventEncoder().event(chunk)
    assert event == sse_event(expected)


def test_a_chat_chunk_has_openais_chat_completion_chunk_shape():
    """Against the official openai client's type of a chat stream chunk."""
    from openai.types.chat import ChatCompletionChunk as OpenAIChunk

    chunk = ChatCompletionChunk(
        id="chatcmpl-1",
        created=7,
        model="m",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="hi"), finish_reason="stop")],
        usage=jsonable(USAGE),
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


@pytest.mark.parametrize("model", ["m", "\ufdd0", 'quo"te \ufdd0 model'])
@pytest.mark.parametrize(
    "text", ["", " plain", 'a "quoted"\n\\ text', "\u2028\x00\x1f", "\ufdd0", "é 😀"]
)
def test_a_text_event_is_its_chunks_event(model, text):
    """The frame rendered once per choice gives, for every text, the bytes of the chunk built
    and encoded whole; an id or model name holding the frame's placeholder does not move the
    text (the chunk of either route)."""
    encoder = EventEncoder()

    def completion(text: str) -> CompletionChunk:
        choice = CompletionChunkChoice(index=3, text=text)
        return CompletionChunk(id="cmpl-\ufdd0", created=7, model=model, choices=[choice])

    def chat(text: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=1, delta=ChatDelta(content=text))
        return ChatCompletionChunk(id="chatcmpl-\ufdd0", created=7, model=model, choices=[choice])

    for chunk_of in (completion, chat):
        assert encoder.text_events(chunk_of)(text) == encoder.event(chunk_of(text))
