"""The OpenAI error shape every failed request must have."""

import httpx


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """`response` is `status` with an OpenAI-shaped error body (naming `param` when given);
    returns the error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
