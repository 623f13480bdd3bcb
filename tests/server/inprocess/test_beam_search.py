"""use_beam_search over HTTP (the app in-process) returns what the offline beam search
returns."""

import pytest

from octavo.engine import LLM, BeamSearchParams
from tests.server.conftest import MODEL_NAME

PROMPT = "The import statement"


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=8)


@pytest.mark.parametrize(
    ("best_of", "n", "length_penalty", "early_stopping"),
    [(4, 2, 1.0, False), (3, 3, 0.5, True), (2, 1, 2.0, "never")],
)
def test_beam_search_over_http_equals_offline(
    http, offline, best_of, n, length_penalty, early_stopping
):
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 12,
        "use_beam_search": True,
        "best_of": best_of,
        "n": n,
        "length_penalty": length_penalty,
        "early_stopping": early_stopping,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    params = BeamSearchParams(
        beam_width=best_of,
        max_tokens=12,
        num_return_sequences=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    expected = offline.beam_search(PROMPT, params, use_tqdm=False)[0].outputs
    assert [c["text"] for c in choices] == [o.text for o in expected]
    assert [c["finish_reason"] for c in choices] == [o.finish_reason for o in expected]
    assert response.json()["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in expected)
