"""The engine core's own process: ZMQ sockets in and out, msgpack messages, one busy loop.

Each API process (one, or --api-server-count of them) binds two IPC sockets, and this process
connects to all of them (`CoreAddresses`): EngineCoreInputs arrive fair-queued on one PULL
socket, and EngineCoreReady, then one EngineCoreOutputs per step (or EngineCoreFailed) leave
on each API process's PUSH socket, with the outputs of that process's requests
(`ClientRouter`). The process owns every CPU thread torch uses for the model; the API
processes keep their cores for HTTP, JSON and detokenization, and none waits on another's
GIL.

Only the API side decides when the core stops: every API process sends
EngineCoreInputs(shutdown=True) once its requests are drained, or the process that started
the core is gone (the core notices within PARENT_CHECK_MS). SIGTERM and SIGINT are ignored
here, whoever sends them, multiprocessing's SIGTERM to daemonic children at interpreter exit
included: an API process closes its core client before it exits (else that exit waits for a
core that never stops). SIGKILL still ends the core at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from octavo.engine.config import EngineConfig
from octavo.engine.core_messages import (
    CoreMessage,
    EngineCoreFailed,
    EngineCoreInputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
)
from octavo.engine.heap import tune_collector_for_serving

logger = logging.getLogger(__name__)

# How often an idle core checks that the API process that spawned it is still alive.
PARENT_CHECK_MS = 1000
# How long the last messages may take to leave when the process ends.
LINGER_MS = 2000
# What a terminal (Ctrl-C: SIGINT) and systemd's default KillMode=control-group (SIGTERM) send
# to every process of the server at once. The API process drains its in-flight requests on
# them, which needs a live core, and stops the core itself afterwards.
SERVER_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class CoreAddresses:
    """The IPC endpoints between a core and the API processes it serves: API process i
    binds `inputs[i]` (it sends EngineCoreInputs there) and `outputs[i]` (it receives the
    outputs of its own requests there); the core connects to all of them."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def in_folder(cls, folder: Path, num_clients: int) -> CoreAddresses:
        """IPC sockets in `folder` (a private temporary folder) for `num_clients` API
        processes."""
        return cls(
            tuple(f"ipc://{folder / f'input-{i}'}" for i in range(num_clients)),
            tuple(f"ipc://{folder / f'output-{i}'}" for i in range(num_clients)),
        )


def run_engine_core(
    config: EngineConfig,
    addresses: CoreAddresses,
    num_threads: int | None,
    parent_pid: int,
) -> None:
    """The process's entry point (a spawn target); exits 0 on shutdown, 1 on a failure
    (reported as EngineCoreFailed first). SIGTERM and SIGINT are ignored (module docstring)."""
    # Here, not at the top: the API processes import this module (its addresses, and this
    # function as their spawn target) and must not pay for loading torch.
    import torch

    from octavo.engine.core.engine_core import EngineCore

    for signum in SERVER_STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    context, inputs, outputs = connect_core_sockets(addresses)
    router = ClientRouter(outputs)
    status = 0
    try:
        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 -- reported to the front end, which raises it
        router.broadcast(EngineCoreFailed(f"{exc}"))
        status = 1
    else:
        tune_collector_for_serving()
        router.broadcast(EngineCoreReady(core.limits, core.stats()))
        try:
            core.run_busy_loop(router.receiver(inputs, parent_pid), router.send)
        except BaseException as exc:
            logger.exception("engine core loop died")
            router.broadcast(EngineCoreFailed(f"{type(exc).__name__}: {exc}"))
            status = 1
    for socket in outputs:
        socket.close(linger=LINGER_MS)
    inputs.close(linger=0)
    context.term()
    sys.exit(status)


def connect_core_sockets(
    addresses: CoreAddresses,
) -> tuple[zmq.Context, zmq.Socket, list[zmq.Socket]]:
    """A core's side of the sockets its API processes bound: (context, one input socket
    fair-queueing all of them, one output socket per API process)."""
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    for address in addresses.inputs:
        inputs.connect(address)
    outputs = []
    for address in addresses.outputs:
        output = context.socket(zmq.PUSH)
        output.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow front end
        output.connect(address)
        outputs.append(output)
    return context, inputs, outputs


class ClientRouter:
    """A core's traffic with its API processes (one, or several with --api-server-count):
    each request's outputs go to the process that sent it, with the stats of the step, whose
    `num_requests_added` counts that process's requests only (it tells how many of its own
    are still on the wire). The core stops once every API process has asked it to."""

    def __init__(self, outputs: list[zmq.Socket]):
        self._outputs = outputs
        self._encoder = msgspec.msgpack.Encoder()
        self._owners: dict[str, int] = {}
        self._added = [0] * len(outputs)
        self._stopped: set[int] = set()

    def broadcast(self, message: CoreMessage) -> None:
        for socket in self._outputs:
            socket.send(self._encoder.encode(message), copy=False)

    def send(self, message: EngineCoreOutputs) -> None:
        """One step's outputs, split by the API process that owns each request."""
        if len(self._outputs) == 1:
            self._outputs[0].send(self._encoder.encode(message), copy=False)
            return
        routed: list[list[EngineCoreOutput]] = [[] for _ in self._outputs]
        for output in message.outputs:
            owner = self._owners.get(output.request_id)
            if owner is None:  # an output after the request's end: nobody waits for it
                continue
            routed[owner].append(output)
            if output.finished:
                del self._owners[output.request_id]
        for client, (socket, outputs) in enumerate(zip(self._outputs, routed, strict=True)):
            stats = msgspec.structs.replace(message.stats, num_requests_added=self._added[client])
            socket.send(self._encoder.encode(EngineCoreOutputs(outputs, stats)), copy=False)

    def _track(self, inputs: EngineCoreInputs) -> EngineCoreInputs:
        """Records who sent each request; a shutdown counts once every process sent one."""
        client = inputs.client_index
        for request in inputs.requests:
            self._owners[request.request_id] = client
        self._added[client] += len(inputs.requests)
        if inputs.shutdown:
            self._stopped.add(client)
            inputs.shutdown = len(self._stopped) == len(self._outputs)
        return inputs

    def receiver(self, socket: zmq.Socket, parent_pid: int):
        """`receive(block)` for the busy loop: the next EngineCoreInputs, or None when none
        is waiting (after waiting, if `block`, until one comes). An orphaned core shuts
        down."""
        decoder = msgspec.msgpack.Decoder(EngineCoreInputs)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)

        def receive(block: bool) -> EngineCoreInputs | None:
            while True:
                if poller.poll(PARENT_CHECK_MS if block else 0):
                    return self._track(decoder.decode(socket.recv(copy=False).buffer))
                if not block:
                    return None
                if os.getppid() != parent_pid:
                    logger.error("the process that started the engine core is gone; it stops")
                    return EngineCoreInputs(shutdown=True)

        return receive
