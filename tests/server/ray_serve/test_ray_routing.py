"""Prefix routing's key (what part of a request places it) and its rendezvous weights."""

import json
from collections import Counter

from octavo.server.ray_serve.routing import (
    ROUTING_KEY_CHARS,
    ROUTING_KEY_TOKENS,
    replica_weight,
    routing_key,
)


def key(body: object, path: str = "/v1/completions") -> str | None:
    return routing_key(path, json.dumps(body).encode())


def test_requests_agreeing_on_the_first_key_length_share_a_key():
    shared = "You are a helpful assistant. " * 20
    assert key({"prompt": shared + "question 1"}) == key({"prompt": shared + "question 2"})
    assert len(key({"prompt": shared})) == ROUTING_KEY_CHARS
    ids = list(range(100))
    assert key({"prompt": ids + [1]}) == key({"prompt": ids + [2]})
    assert key({"prompt": [ids + [1], [5]]}) == key({"prompt": ids})  # a batch: its first
    assert key({"prompt": ids[: ROUTING_KEY_TOKENS - 1] + [7]}) != key({"prompt": ids})
    system = {"role": "system", "content": shared}
    first = key({"messages": [system, {"role": "user", "content": "a"}]}, "/v1/chat/completions")
    second = key({"messages": [system, {"role": "user", "content": "b"}]}, "/v1/chat/completions")
    assert first == second and first.startswith("system:")


def test_other_routes_and_bad_bodies_have_no_key():
    assert key({"prompt": "x"}, "/v1/models") is None
    assert routing_key("/v1/completions", b"{not json") is None
    assert key([1, 2]) is None and key({"prompt": 3}) is None and key({"messages": "x"}) is None


def test_rendezvous_weights_spread_keys_and_move_only_a_removed_replicas_keys():
    replicas = ["a1", "b2", "c3", "d4"]
    keys = [f"prefix {i}" for i in range(2000)]

    def owner(k: str, live: list[str]) -> str:
        return max(live, key=lambda r: replica_weight(k, r))

    placed = {k: owner(k, replicas) for k in keys}
    assert min(Counter(placed.values()).values()) > 2000 / len(replicas) * 0.8
    survivors = replicas[1:]
    moved = [k for k in keys if owner(k, survivors) != placed[k]]
    assert all(placed[k] == "a1" for k in moved)  # only the removed replica's keys move
