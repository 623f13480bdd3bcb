"""A server-sent-events parser written from the specification: the oracle of SSE framing."""

import re


def parse_sse(stream: bytes) -> list[str]:
    """The data of each event a browser's EventSource would dispatch (WHATWG HTML, "Server-sent
    events", interpreting an event stream): lines end at CRLF, LF or CR; a blank line
    dispatches the event; `data:` lines (one optional space after the colon) append to its
    data, joined by LF; other fields and comments are ignored."""
    events, data, dispatched = [], [], True
    for line in re.split(r"\r\n|\n|\r", stream.decode("utf-8")):
        if not line:
            if data:
                events.append("\n".join(data))
            data, dispatched = [], True
            continue
        dispatched = False
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    assert dispatched, "the stream ends inside an event, which a client would drop"
    return events
