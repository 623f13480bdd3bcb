"""SSE framing and the stream-delta tracker's holdback of possible stop-string prefixes."""

from octavo.engine.outputs import CompletionOutput
from octavo.server.protocol import CompletionChoice, CompletionResponse
from octavo.server.streaming import SSE_DONE, ChoiceStream, sse_event


def output(text: str, tokens: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, list(range(tokens)), 0.0, None, finish)


def test_sse_event_is_one_data_line_and_a_blank_line():
    chunk = CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text="a\nb")]
    )
    event = sse_event(chunk)
    assert event.startswith("data: {") and event.endswith("}\n\n")
    assert event.count("\n") == 2  # the newline inside the text is JSON-escaped
    assert SSE_DONE == "data: [DONE]\n\n"


def test_holdback_never_sends_what_a_stop_string_may_cut():
    stream = ChoiceStream(holdback=3)  # longest stop string has 4 characters
    assert stream.next(output("ab", 1)).text == ""  # a token, but its text may be cut
    assert stream.next(output("ab", 1)) is None  # nothing new at all
    assert stream.next(output("abcdef", 2)).text == "abc"
    assert stream.next(output("abcdefg", 3)).text == "d"
    # The engine found the stop string starting at "efg..." and cut it: flush what is left.
    final = stream.next(output("abcd", 4, "stop"))
    assert final.text == "" and stream.finished


def test_without_stop_strings_every_new_character_goes_out_at_once():
    stream = ChoiceStream(holdback=0)
    deltas = [
        stream.next(output(t, n))
        for t, n in [("a", 1), ("ab", 2), ("ab", 3), ("ab", 3), ("abc", 4)]
    ]
    # The third token completes no character yet: a chunk with empty text; then nothing new.
    assert [d.text if d else None for d in deltas] == ["a", "b", "", None, "c"]
    assert stream.next(output("abc", 5, "length")).text == ""
