"""The code examples of README.md and of the docs' getting-started page run as written
against the embedded default model: the curl commands as httpx requests to the in-process
app (method, path, headers and body taken from the command), the Python blocks executed with
the openai client's base URL pointing at that app. The blocks are read from the Markdown, so
a changed example is tested as it now reads."""

import json
import re
import shlex
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Where the examples expect `make serve`.
SERVER_URL = "http://127.0.0.1:8000"


def examples(page: Path, language: str) -> list[str]:
    return [code for lang, code in FENCE.findall(page.read_text()) if lang == language]


def curl_examples(page: Path) -> list[str]:
    return [code for code in examples(page, "bash") if code.lstrip().startswith("curl ")]


def python_examples(page: Path) -> list[str]:
    return examples(page, "python")


def test_every_page_has_examples():
    readme = ROOT / "README.md"
    assert len(curl_examples(readme)) == 1 and len(python_examples(readme)) == 2
    assert python_examples(ROOT / "docs" / "getting-started.md")


def parse_curl(command: str) -> tuple[str, str, dict[str, str], dict]:
    """(method, path, headers, JSON body) of a `curl URL -H ... -d ...` command."""
    words = shlex.split(command.replace("\\\n", " "))
    url, headers, body = "", {}, None
    i = 1
    while i < len(words):
        word = words[i]
        if word == "-H":
            name, _, value = words[i + 1].partition(":")
            headers[name.strip()] = value.strip()
            i += 2
        elif word == "-d":
            body = json.loads(words[i + 1])
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            url = word
            i += 1
    assert url.startswith(SERVER_URL), url
    return ("POST" if body is not None else "GET"), url[len(SERVER_URL) :], headers, body


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_curl_examples(page, default_server):
    for command in curl_examples(page):
        method, path, headers, body = parse_curl(command)
        response = default_server.http.request(method, path, headers=headers, json=body)
        assert response.status_code == 200, response.text
        if body and body.get("stream"):
            events = [e for e in response.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(bool(c["choices"][0]["text"]) for c in chunks) >= 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_examples(page, default_server, monkeypatch, capsys):
    in_process = default_server.openai()

    def client(base_url: str, api_key: str) -> openai.OpenAI:
        assert base_url == f"{SERVER_URL}/v1"
        return in_process

    monkeypatch.setattr(openai, "OpenAI", client)
    monkeypatch.chdir(ROOT)  # the offline example names the embedded model by its path
    for code in python_examples(page):
        exec(compile(code, f"{page.name} example", "exec"), {})
        printed = capsys.readouterr().out
        assert printed.strip(), code
