"""The endpoints beside completions, in vLLM's shapes: /tokenize, /detokenize, /version,
/v1/models and /v1/models/{id}."""

import importlib.metadata
from types import SimpleNamespace

import httpx
import openai
import pytest

from octavo.engine.frontend.tokenizer import Tokenizer
from octavo.server.errors import APIError
from octavo.server.protocol import DetokenizeRequest, TokenizeRequest
from octavo.server.serving_engine import ServerConfig
from octavo.server.serving_tokenization import TokenizationServing
from tests.server.conftest import MODEL_NAME


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


def test_tokenize_then_detokenize_round_trips(server, tiny_model_dir):
    text = "The café menu, twice: café!"
    out = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert out.status_code == 200
    body = out.json()
    tokenizer = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == 256  # the tiny checkpoint's n_positions
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # The token ids are the ones a completion of the same text is counted with.
    usage = post(
        server, "/v1/completions", {"model": MODEL_NAME, "prompt": text, "max_tokens": 1}
    ).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_tokenize_can_return_each_tokens_text(server):
    body = post(server, "/tokenize", {"prompt": "Lists are", "return_token_strs": True}).json()
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
def test_bad_tokenization_requests_name_the_field(server, path, body, status, param):
    out = post(server, path, body)
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


def test_model_cards_and_version(server, tiny_model_dir):
    listed = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
    (card,) = listed["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == tiny_model_dir and card["parent"] is None
    assert card["max_model_len"] == 256
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"]
    one = httpx.get(f"{server.base_url}/v1/models/{MODEL_NAME}", timeout=10)
    assert one.status_code == 200 and one.json()["id"] == MODEL_NAME
    missing = httpx.get(f"{server.base_url}/v1/models/gpt-4", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    version = httpx.get(f"{server.base_url}/version", timeout=10).json()
    assert version == {"version": importlib.metadata.version("octavo")}
