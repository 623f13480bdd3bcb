"""The bearer keys a server accepts and the users they stand for (--api-key, --api-key-file,
$OCTAVO_API_KEY): read at startup, refused by name when unusable."""

import pytest

from octavo.server.launch import api_keys_of
from octavo.server.server_args import API_KEY_ENV


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def test_no_key_is_no_auth():
    assert api_keys_of(None, None) is None


def test_flag_keys_are_named_in_order_and_the_file_adds_named_ones(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team\nalice sk-alice\n\nsk-anon\n  bob   sk-bob  \n")
    assert api_keys_of(("sk-1", "sk-2"), str(path)) == {
        "sk-1": "key0", "sk-2": "key1", "sk-alice": "alice", "sk-anon": "key3", "sk-bob": "bob",
    }  # fmt: skip


def test_the_environment_key_serves_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert api_keys_of(None, None) == {"sk-env": "key0"}
    assert api_keys_of(("sk-flag",), None) == {"sk-flag": "key0"}


@pytest.mark.parametrize(
    ("flag", "lines", "match"),
    [
        (("",), None, "must not be empty"),
        (("  ",), None, "must not be empty"),
        (("k", "k"), None, "given twice"),
        (None, "alice k1\nalice k2\n", "given twice"),
        (("k",), "k\n", "given twice"),
        (None, "a b c\n", ":1: expected KEY or NAME KEY"),
    ],
)
def test_unusable_keys_are_refused_by_flag(tmp_path, flag, lines, match):
    path = None
    if lines is not None:
        (tmp_path / "keys").write_text(lines)
        path = str(tmp_path / "keys")
    with pytest.raises(ValueError, match=match):
        api_keys_of(flag, path)


def test_an_empty_environment_key_is_refused(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(ValueError, match="must not be empty"):
        api_keys_of(None, None)


def test_an_unreadable_key_file_is_refused_by_flag(tmp_path):
    with pytest.raises(ValueError, match="--api-key-file: cannot read"):
        api_keys_of(None, str(tmp_path / "missing"))
