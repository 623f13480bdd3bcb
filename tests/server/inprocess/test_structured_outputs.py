"""Structured outputs over HTTP (the app in-process): OpenAI's response_format through the
official client (`chat.completions.parse` with a pydantic model too), vLLM's guided_* fields
and structured_outputs object, streamed and not; every invalid or conflicting constraint is
a 400 naming the field the client sent. The tiny model's weights are random: only the
constraint makes its outputs valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from octavo.server import serving_engine
from tests.server.conftest import MODEL_NAME

PROMPT = "The verdict:"
MESSAGES = [{"role": "user", "content": "Give me the verdict."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe not"]
SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 48}


class Verdict(BaseModel):
    ok: bool
    label: Literal["yes", "no"]


def test_guided_choice_over_completions(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=3, extra_body={"guided_choice": CHOICES}, **SAMPLED
    )
    assert [c.text in CHOICES for c in completion.choices] == [True] * 3
    assert {c.finish_reason for c in completion.choices} == {"stop"}


def test_response_format_json_schema_over_chat(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        n=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
        },
        **SAMPLED,
    )
    stopped = [c for c in completion.choices if c.finish_reason == "stop"]
    assert stopped
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_over_chat(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, response_format={"type": "json_object"},
        n=4, **SAMPLED,
    )  # fmt: skip
    texts = [c.message.content for c in completion.choices]
    assert all(t.startswith("{") for t in texts), texts
    stopped = [c.message.content for c in completion.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in stopped)


def test_the_openai_clients_parse_fills_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, response_format=Verdict, **SAMPLED
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Verdict), message.content


def test_beam_search_follows_the_constraint(http):
    response = http.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "use_beam_search": True,
            "best_of": 3, "n": 2, "guided_choice": CHOICES,
        },
    )  # fmt: skip
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and all(c["text"] in CHOICES for c in choices), choices


def test_streamed_deltas_concatenate_to_a_valid_output(client):
    regex = r"[a-z]{3,8}-[0-9]{2}"
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stream=True, extra_body={"guided_regex": regex},
        **SAMPLED,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, text), text


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_grammar": 'root ::= "a" [bc]+ "d"'}, lambda t: re.fullmatch("a[bc]+d", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"response_format": {"type": "text"}, "ignore_eos": True}, lambda t: True),
    ],
)
def test_vllm_fields_over_raw_http(http, body, check):
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **SAMPLED, **body}
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert check(choice["text"]), choice["text"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "a" * 70_000}, "guided_regex"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
        ({"guided_choice": ["a"], "use_beam_search": True, "min_tokens": 1}, "min_tokens"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_field(http, body, param):
    response = http.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_constraint_that_compiles_too_long_is_a_400_and_the_server_goes_on(http, monkeypatch):
    """The compile runs in a thread, bounded in time: past the bound the request is refused
    and nothing reaches the engine; the next request is served."""
    monkeypatch.setattr(serving_engine, "GRAMMAR_COMPILE_TIMEOUT_S", 0.0)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}
    # A regex no earlier test compiled (a cached one compiles at once).
    response = http.post("/v1/completions", json=body | {"guided_regex": "[a-f]{3}z[0-9]{7}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "guided_regex"
    monkeypatch.undo()
    assert http.post("/v1/completions", json=body).status_code == 200


def test_a_bad_schema_through_the_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        )
    assert raised.value.body["param"] == "response_format"
