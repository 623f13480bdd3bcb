"""What the ingress and the engine replicas send each other through Ray: plain, picklable
dataclasses (the request as received, the response's head, its body in chunks, a replica's
stats)."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.engine.core_messages import EngineStats

# The response header naming the replica that served a request (its Ray Serve replica id).
REPLICA_HEADER = "x-octavo-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it, whole. `routing_key` is the prompt's
    prefix that prefix routing places by (None: route by load alone)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    routing_key: str | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The head of a replica's response: the first item of every response stream."""

    status: int
    headers: list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class ReplicaStats:
    """What `EngineReplica.stats` answers: which replica (its Ray Serve id and its process),
    and its engine's stats after the latest step."""

    replica_id: str
    pid: int
    engine: EngineStats
