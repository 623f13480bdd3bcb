"""The embedded default model served in-process, as `make serve` serves it (model name
octavo-tiny-chat), for the docs' examples and the generated reference pages."""

from collections.abc import Iterator

import pytest

from octavo.server.server_args import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer


@pytest.fixture(scope="session")
def default_server() -> Iterator[InProcessServer]:
    server = InProcessServer(str(DEFAULT_MODEL), served_model_name=DEFAULT_MODEL_NAME)
    try:
        yield server
    finally:
        server.close()
