"""ClientRouter: a core's traffic with several API processes (--api-server-count). Each
request's outputs reach the process that sent it, with that process's own request count; the
core stops only once every process has asked."""

import os

import msgspec
import pytest
import zmq

from octavo.engine.core.core_process import ClientRouter
from octavo.engine.core_messages import (
    CoreMessage,
    EngineCoreInputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
)
from octavo.engine.sampling_params import SamplingParams


class RecordingSocket:
    """Stands in for a ZMQ socket: keeps the messages sent, decoded."""

    def __init__(self):
        self.messages = []

    def send(self, data, copy=True):
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        self.messages.append(decoder.decode(bytes(data)))


def stats(added: int) -> EngineStats:
    return EngineStats(2, 0, 10, 10, 0.0, 0, 0, 0, added, 0, 0, 0)


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2], 0.0, [], SamplingParams(max_tokens=4))


class Inputs:
    """The core's inputs socket over the in-process transport: `socket` is the core's end,
    `send` the API processes'."""

    def __init__(self, context: zmq.Context):
        self.socket, self._push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        self.socket.bind("inproc://core-inputs")
        self._push.connect("inproc://core-inputs")
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, inputs: EngineCoreInputs) -> None:
        self._push.send(self._encoder.encode(inputs))

    def close(self) -> None:
        self._push.close(linger=0)
        self.socket.close(linger=0)


@pytest.fixture
def inputs():
    context = zmq.Context()
    wire = Inputs(context)
    yield wire
    wire.close()
    context.term()


def track(router: ClientRouter, inputs: Inputs, sent: EngineCoreInputs) -> EngineCoreInputs:
    """What the core's busy loop receives through the router when an API process sends
    `sent`."""
    inputs.send(sent)
    return router.receiver(inputs.socket, os.getppid())(True)


def test_outputs_reach_the_process_that_sent_the_request(inputs):
    sockets = [RecordingSocket(), RecordingSocket()]
    router = ClientRouter(sockets)
    sent = EngineCoreInputs(requests=[request("a"), request("b")], client_index=0)
    assert track(router, inputs, sent) == sent  # the core gets the requests as sent
    track(router, inputs, EngineCoreInputs(requests=[request("c")], client_index=1))
    step = [
        EngineCoreOutput("a"),
        EngineCoreOutput("c", finished=True),
        EngineCoreOutput("b", finished=True),
    ]
    router.send(EngineCoreOutputs(step, stats(3)))
    first, second = (socket.messages[-1] for socket in sockets)
    assert [o.request_id for o in first.outputs] == ["a", "b"]
    assert [o.request_id for o in second.outputs] == ["c"]
    # Each process hears of its own requests taken in: 2 of its 2, 1 of its 1.
    assert (first.stats.num_requests_added, second.stats.num_requests_added) == (2, 1)
    # A finished request has no owner left: a late output of it goes nowhere.
    router.send(EngineCoreOutputs([EngineCoreOutput("c")], stats(3)))
    assert [socket.messages[-1].outputs for socket in sockets] == [[], []]


def test_the_core_stops_once_every_process_asked(inputs):
    router = ClientRouter([RecordingSocket(), RecordingSocket()])
    assert not track(router, inputs, EngineCoreInputs(shutdown=True, client_index=1)).shutdown
    assert not track(router, inputs, EngineCoreInputs(shutdown=True, client_index=1)).shutdown
    assert track(router, inputs, EngineCoreInputs(shutdown=True, client_index=0)).shutdown


def test_one_process_gets_the_core_messages_unchanged(inputs):
    socket = RecordingSocket()
    router = ClientRouter([socket])
    message = EngineCoreOutputs([EngineCoreOutput("x", finished=True)], stats(7))
    router.send(message)
    assert socket.messages == [message]
    assert track(router, inputs, EngineCoreInputs(shutdown=True)).shutdown
