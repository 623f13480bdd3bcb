"""Prefix-affinity routing for Ray Serve: a request goes to the replica its prompt's prefix
hashes to, so requests that share a prefix share that replica's prefix cache.

Placement is rendezvous (highest-random-weight) hashing of the routing key over the live
replicas: every router (one per ingress replica) agrees without shared state, distinct
prefixes spread evenly, and when a replica comes or goes only the prefixes it wins or held
move. Load still wins when it must: if the prefix's replica has more ongoing requests than
the least busy candidate by more than `imbalance`, the request goes to the less busy of two
random replicas, as Ray's default power-of-two-choices router would send it. The key is a
prompt's first ROUTING_KEY_CHARS characters (or ROUTING_KEY_TOKENS token ids), so prompts
that agree that far land together; ones that share less than that do not.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from octavo.server.ray_serve.messages import ForwardedRequest
from octavo.server.server_args import ServerArgs

# The key's length: about four 16-token KV blocks, of text or of token ids. Long enough to
# tell prompt templates apart, short enough that a shared system prompt or few-shot header
# decides it alone. Prompts that share less than this do not land together.
ROUTING_KEY_CHARS = 256
ROUTING_KEY_TOKENS = 64
PROMPT_ROUTES = ("/v1/completions", "/v1/chat/completions")


def routing_key(path: str, body: bytes) -> str | None:
    """The prefix a request is placed by: the first ROUTING_KEY_CHARS characters of its
    prompt, or ROUTING_KEY_TOKENS token ids (completions: the first prompt; chat: the
    messages' roles and text in order). None for any other route, or a body that is not a
    JSON object with a prompt: the replica that gets it answers the 4xx."""
    if path not in PROMPT_ROUTES:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    if "messages" in payload:
        key = _messages_text(payload["messages"])[:ROUTING_KEY_CHARS]
    else:
        key = _prompt_key(payload.get("prompt"))
    return key or None


def _prompt_key(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt places it
    if isinstance(prompt, str):
        return prompt[:ROUTING_KEY_CHARS]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt[:ROUTING_KEY_TOKENS])) + ","
    return ""


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else ''}")
    return "\n".join(parts)


def replica_weight(key: str, replica_id: str) -> int:
    """The rendezvous weight of a replica for a key: the key goes to the largest."""
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """A Ray Serve RequestRouter: the prefix's replica first while load is balanced, else
    power of two choices (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: `imbalance`, the ongoing requests by which the prefix's replica may
        exceed the least busy candidate before load decides."""
        self._imbalance = int(kwargs.get("imbalance", ServerArgs.routing_imbalance))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = _key_of(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [_two_random(candidate_replicas)]
        ranked = sorted(
            candidate_replicas,
            key=lambda r: replica_weight(key, r.replica_id.unique_id),
            reverse=True,
        )
        loads = await self._queue_lens(ranked)
        preferred = loads.get(ranked[0].replica_id.unique_id)
        known = [n for n in loads.values() if n is not None]
        if preferred is not None and known and preferred - min(known) > self._imbalance:
            return [_two_random(candidate_replicas)]
        # Ranks: the prefix's replica, then the rest (taken when its queue is full).
        return [ranked[:1], ranked[1:]]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Ongoing requests per replica: from the router's cache, probing the ones missing."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id.unique_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if loads[r.replica_id.unique_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                loads[replica.replica_id.unique_id] = queue_len
        return loads


def _key_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request.routing_key if isinstance(request, ForwardedRequest) else None


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
