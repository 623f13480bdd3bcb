"""SSE framing: one data line per event, [DONE] last."""

from octavo.server.protocol import CompletionChoice, CompletionResponse
from octavo.server.streaming import SSE_DONE, sse_event


def test_sse_event_is_one_data_line_and_a_blank_line():
    chunk = CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text="a\nb")]
    )
    event = sse_event(chunk)
    assert event.startswith("data: {") and event.endswith("}\n\n")
    assert event.count("\n") == 2  # the newline inside the text is JSON-escaped
    assert SSE_DONE == "data: [DONE]\n\n"
