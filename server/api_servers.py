"""`octavo serve --api-server-count N`: N API server processes in front of one engine core.

The process `octavo serve` starts becomes a supervisor. It binds N listening sockets on
--host/--port with SO_REUSEPORT (the kernel spreads connections over them), starts the
engine core and N API processes, and waits. Each API process serves one socket with its own
event loop, output processor and detokenizer; the core routes each request's outputs back to
the process that sent it (`core_process.ClientRouter`). /metrics answers the same in every
process: the core's counters, and the latency histograms of all of them
(prometheus-client's multiprocess mode, in a folder the supervisor owns).

Stopping: SIGTERM or SIGINT may reach the supervisor alone or every process at once
(systemd's KillMode=control-group signals the whole cgroup, Ctrl-C the process group), so the
API processes and the core ignore both, and the supervisor forwards each one it receives as
DRAIN_SIGNAL: the first drains every API process (as `octavo serve` drains on SIGTERM), a
second aborts at once. Each API process tells the core it is done; the core stops when all
have. An API process that exits non-zero (the core died: its streams got their error
events) makes the supervisor drain the others and exit non-zero too.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing.process import BaseProcess
from pathlib import Path

from octavo.engine.core.core_process import SERVER_STOP_SIGNALS, CoreAddresses, run_engine_core
from octavo.engine.frontend.core_client import CORE_EXIT_TIMEOUT_S, SharedCore
from octavo.server.launch import PROMETHEUS_DIR_ENV, model_threads, run_http_server
from octavo.server.server_args import ServerArgs

# What the supervisor sends its API processes for each stop signal it receives: a signal
# neither a terminal nor systemd sends on its own.
DRAIN_SIGNAL = signal.SIGUSR1
LISTEN_BACKLOG = 2048

logger = logging.getLogger(__name__)


def serve_with_api_servers(args: ServerArgs, count: int) -> int:
    """Runs the supervisor until every API process has exited; the exit status: 0 when all
    drained cleanly, else the first non-zero status of an API process (1: the core died; 2:
    it could not start)."""
    threads = model_threads(args)
    try:
        sockets = [_listening_socket(args.host, args.port) for _ in range(count)]
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from exc
    folder = Path(tempfile.mkdtemp(prefix="octavo-api-servers-"))
    metrics_dir = folder / "metrics"
    metrics_dir.mkdir()
    # Read by prometheus-client when an API process imports it (spawned children inherit it).
    os.environ[PROMETHEUS_DIR_ENV] = str(metrics_dir)
    addresses = CoreAddresses.in_folder(folder, count)
    context = multiprocessing.get_context("spawn")
    core = context.Process(
        target=run_engine_core,
        args=(args.engine, addresses, threads, os.getpid()),
        name="octavo-engine-core",
    )
    workers: list[BaseProcess] = []
    try:
        core.start()
        assert core.pid is not None, "started"
        workers = [
            context.Process(
                target=run_api_server,
                args=(args, SharedCore(addresses, index, core.pid), sockets[index]),
                name=f"octavo-api-server-{index}",
            )
            for index in range(count)
        ]
        for worker in workers:
            worker.start()
        for sock in sockets:
            sock.close()  # the API processes hold their own

        for signum in SERVER_STOP_SIGNALS:
            signal.signal(signum, lambda *_: _drain(workers))
        status = _wait_for(workers)
        core.join(CORE_EXIT_TIMEOUT_S)
        if core.is_alive():
            logger.warning("the engine core did not exit; killing it")
        elif core.exitcode != 0 and status == 0:
            status = 1
        return status
    finally:
        for child in [core, *workers]:  # anything left (an error above): never an orphan
            if child.pid is not None and child.is_alive():
                child.kill()
                child.join()
        shutil.rmtree(folder, ignore_errors=True)


def _drain(workers: list[BaseProcess]) -> None:
    """Sends DRAIN_SIGNAL to every API process still running."""
    for worker in workers:
        if worker.is_alive():
            os.kill(worker.pid, DRAIN_SIGNAL)  # type: ignore[arg-type]  # started


def _wait_for(workers: list[BaseProcess]) -> int:
    """Waits for every API process; the first to fail makes the others drain."""
    status = 0
    pending = {worker.sentinel: worker for worker in workers}
    while pending:
        for sentinel in multiprocessing.connection.wait(list(pending)):
            assert isinstance(sentinel, int), "process sentinels are descriptors"
            worker = pending.pop(sentinel)
            worker.join()
            code = worker.exitcode or 0
            if code != 0 and status == 0:
                logger.error("%s exited with status %s; stopping the others", worker.name, code)
                status = code if code > 0 else 1
                _drain(workers)
    return status


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port beside the others of the same port (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def run_api_server(args: ServerArgs, shared: SharedCore, sock: socket.socket) -> None:
    """An API process (a spawn target): the app of `args` over the shared core, on `sock`;
    drains on DRAIN_SIGNAL and ignores the stop signals (module docstring). Exits 0 once
    drained, 1 if the core died, 2 if it could not start."""
    for signum in SERVER_STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[api {shared.client_index}]: %(message)s",
    )
    try:
        sys.exit(run_http_server(args, shared, sock, (DRAIN_SIGNAL,)))
    except ValueError as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        sys.exit(2)
