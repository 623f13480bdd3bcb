"""The endpoints beside completions, in vLLM's shapes: /tokenize, /detokenize, /version,
/v1/models and /v1/models/{id} (the app in-process; the round trip against the tokenizers
library is in test_routes.py)."""

import importlib.metadata
from types import SimpleNamespace

import pytest

from octavo.server.errors import APIError
from octavo.server.protocol import DetokenizeRequest, TokenizeRequest
from octavo.server.serving_engine import ServerConfig
from octavo.server.serving_tokenization import TokenizationServing
from tests.server.conftest import MODEL_NAME


def test_tokenize_can_return_each_tokens_text(http):
    body = http.post("/tokenize", json={"prompt": "Lists are", "return_token_strs": True}).json()
    assert "".join(body["token_strs"]) == "Lists are"
    assert len(body["token_strs"]) == body["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_tokenization_requests_name_the_field(http, path, body, status, param):
    out = http.post(path, json=body)
    assert out.status_code == status
    assert out.json()["error"]["param"] == param


def test_a_model_without_a_tokenizer_says_so():
    engine = SimpleNamespace(tokenizer=None, max_model_len=64, vocab_size=100)
    serving = TokenizationServing(engine, ServerConfig(served_model_name="m"))  # type: ignore[arg-type]
    with pytest.raises(APIError) as raised:
        serving.tokenize(TokenizeRequest(prompt="x"))
    assert raised.value.status == 400 and "tokenizer" in raised.value.message
    with pytest.raises(APIError):
        serving.detokenize(DetokenizeRequest(tokens=[1]))


def test_model_cards_and_version(http, client, tiny_model_dir):
    listed = http.get("/v1/models").json()
    (card,) = listed["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == tiny_model_dir and card["parent"] is None
    assert card["max_model_len"] == 256
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"]
    one = http.get(f"/v1/models/{MODEL_NAME}")
    assert one.status_code == 200 and one.json()["id"] == MODEL_NAME
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    version = http.get("/version").json()
    assert version == {"version": importlib.metadata.version("octavo")}
