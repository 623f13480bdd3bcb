"""`octavo serve --speculative-config` (n-gram, and a draft model) over HTTP: greedy streams
and chat carry exactly the text, logprobs and usage of the server without it, stop strings
included, while drafts are verified and accepted (the /metrics counters)."""

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})  # fmt: skip
PASSAGE = "the while statement is used for repeated execution as long as an expression is true"


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def speculative(request, tiny_model_dir) -> Iterator[httpx.Client]:
    """A server speculating by prompt lookup, or with the served model as its own draft."""
    config = NGRAM
    if request.param == "draft_model":
        config = json.dumps({"model": tiny_model_dir, "num_speculative_tokens": 3})
    app = InProcessServer(tiny_model_dir, engine_args={"speculative_config": config})
    try:
        yield app.http
    finally:
        app.close()


def stream(http: httpx.Client, path: str, body: dict) -> list[dict]:
    response = http.post(path, json=body | {"model": MODEL_NAME, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def content(events: list[dict]) -> list[dict]:
    """What a client keeps of a stream: the choices' text and logprobs, and the usage."""
    kept = []
    for event in events:
        for choice in event["choices"]:
            delta = choice.get("delta", {})
            kept.append({
                "index": choice["index"], "text": choice.get("text", delta.get("content")),
                "logprobs": choice.get("logprobs"), "finish_reason": choice["finish_reason"],
            })  # fmt: skip
        if event.get("usage"):
            kept.append({"usage": event["usage"]})
    return kept


def joined(kept: list[dict]) -> tuple[str, list, list]:
    """The text, finish reasons and token counts. Cached prompt tokens are left out: they
    follow what the shared server computed before (its prefix cache), not this request."""
    text = "".join(k["text"] or "" for k in kept if "text" in k)
    reasons = [k["finish_reason"] for k in kept if k.get("finish_reason")]
    usage = [
        {key: value for key, value in k["usage"].items() if key != "prompt_tokens_details"}
        for k in kept
        if "usage" in k
    ]
    return text, reasons, usage


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": f"{PASSAGE}. again: {PASSAGE[:30]}", "max_tokens": 40}),
        ("/v1/completions", {"prompt": f"{PASSAGE}. again: {PASSAGE[:30]}", "max_tokens": 40,
                             "logprobs": 2, "stop": [" is"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PASSAGE}],
                                  "max_tokens": 40}),
    ],
    ids=["completion", "logprobs_and_stop", "chat"],
)  # fmt: skip
def test_greedy_streams_are_the_unspeculated_servers(http, speculative, path, body):
    body = body | {"temperature": 0, "stream_options": {"include_usage": True}}
    plain, spec = (
        joined(content(stream(http, path, body))),
        joined(content(stream(speculative, path, body))),
    )
    assert plain == spec
    assert plain[0]  # some text came out
    if "logprobs" in body:
        # The logprobs of every token too (they are the same tokens, one event each or not).
        tokens = [lp for e in stream(http, path, body) for c in e["choices"] if c["logprobs"]
                  for lp in c["logprobs"]["token_logprobs"]]  # fmt: skip
        spec_tokens = [lp for e in stream(speculative, path, body) for c in e["choices"]
                       if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]  # fmt: skip
        assert spec_tokens == pytest.approx(tokens, abs=1e-5)


def test_drafts_are_verified_and_counted(speculative):
    # A bias that makes the output one token over and over: prompt lookup proposes it, and
    # verification must accept it (an untrained model repeats the passage only by chance).
    body = {"prompt": f"{PASSAGE}. again: {PASSAGE[:30]}", "max_tokens": 40, "temperature": 0,
            "logit_bias": {"65": 100}}  # fmt: skip
    stream(speculative, "/v1/completions", body)
    metrics = speculative.get("/metrics").text
    counts = {
        name: float(re.search(rf"^octavo:{name}_total (\S+)$", metrics, re.MULTILINE).group(1))
        for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    }
    assert 0 < counts["spec_decode_num_accepted_tokens"] <= counts["spec_decode_num_draft_tokens"]
    first = re.search(
        r'^octavo:spec_decode_num_accepted_tokens_per_pos_total\{position="0"\} (\S+)$',
        metrics, re.MULTILINE,
    )  # fmt: skip
    assert (
        first is not None and 0 < float(first.group(1)) <= counts["spec_decode_num_accepted_tokens"]
    )
