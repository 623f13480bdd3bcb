"""The engine core's own process: ZMQ sockets in and out, msgpack messages, one busy loop.

The front end (API process) binds two IPC sockets and spawns this process, which connects:
EngineCoreInputs arrive on a PULL socket, and EngineCoreReady, then one EngineCoreOutputs per
step (or EngineCoreFailed) leave on a PUSH socket. The process owns every CPU thread torch
uses for the model; the API process keeps its core(s) for HTTP, JSON and detokenization, and
neither waits on the other's GIL.

Only the API side decides when the core stops: it sends EngineCoreInputs(shutdown=True) once
its requests are drained, or it is gone (the core notices within PARENT_CHECK_MS). SIGTERM and
SIGINT are ignored here, whoever sends them, multiprocessing's SIGTERM to daemonic children at
interpreter exit included: an API process closes its core client before it exits (else that
exit waits for a core that never stops). SIGKILL still ends the core at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import torch
import zmq

from octavo.engine.config import EngineConfig
from octavo.engine.core_messages import (
    CoreMessage,
    EngineCoreFailed,
    EngineCoreInputs,
    EngineCoreReady,
)
from octavo.engine.engine_core import EngineCore
from octavo.engine.heap import freeze_startup_heap

logger = logging.getLogger(__name__)

# How often an idle core checks that the API process that spawned it is still alive.
PARENT_CHECK_MS = 1000
# How long the last messages may take to leave when the process ends.
LINGER_MS = 2000
# What a terminal (Ctrl-C: SIGINT) and systemd's default KillMode=control-group (SIGTERM) send
# to every process of the server at once. The API process drains its in-flight requests on
# them, which needs a live core, and stops the core itself afterwards.
SERVER_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    num_threads: int | None,
    parent_pid: int,
) -> None:
    """The process's entry point (a spawn target); exits 0 on shutdown, 1 on a failure
    (reported as EngineCoreFailed first). SIGTERM and SIGINT are ignored (module docstring)."""
    for signum in SERVER_STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    context, inputs, outputs = connect_core_sockets(input_address, output_address)
    encoder = msgspec.msgpack.Encoder()

    def send(message: CoreMessage) -> None:
        outputs.send(encoder.encode(message), copy=False)

    status = 0
    try:
        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 -- reported to the front end, which raises it
        send(EngineCoreFailed(f"{exc}", startup=True))
        status = 1
    else:
        freeze_startup_heap()
        send(EngineCoreReady(core.limits, core.stats()))
        try:
            core.run_busy_loop(_receiver(inputs, parent_pid), send)
        except BaseException as exc:
            logger.exception("engine core loop died")
            send(EngineCoreFailed(f"{type(exc).__name__}: {exc}", startup=False))
            status = 1
    outputs.close(linger=LINGER_MS)
    inputs.close(linger=0)
    context.term()
    sys.exit(status)


def connect_core_sockets(
    input_address: str, output_address: str
) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """A core's side of the two sockets the front end bound: (context, inputs, outputs)."""
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow front end
    outputs.connect(output_address)
    return context, inputs, outputs


def _receiver(socket: zmq.Socket, parent_pid: int):
    """`receive(block)` for the busy loop: the next EngineCoreInputs, or None when none is
    waiting (after waiting, if `block`, until one comes). An orphaned core shuts down."""
    decoder = msgspec.msgpack.Decoder(EngineCoreInputs)
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)

    def receive(block: bool) -> EngineCoreInputs | None:
        while True:
            if poller.poll(PARENT_CHECK_MS if block else 0):
                return decoder.decode(socket.recv(copy=False).buffer)
            if not block:
                return None
            if os.getppid() != parent_pid:
                logger.error("the API process is gone; the engine core stops")
                return EngineCoreInputs(shutdown=True)

    return receive
