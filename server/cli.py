"""The `octavo` command line: the only place arguments (and, later, environment) are read."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI

from octavo.engine.async_engine import ABORT_DRAIN_SECONDS, AsyncEngine
from octavo.engine.config import EngineConfig
from octavo.engine.core_client import SharedCore
from octavo.engine.heap import freeze_startup_heap
from octavo.engine.worker.models.weights import load_model_config
from octavo.server.http_guards import LOOPBACK_HOSTS, http_with_header_timeout

# The tiny GPT-2 trained on Python's reference text (tools/train_default_model.py).
DEFAULT_MODEL = Path(__file__).parent / "default_model"
DEFAULT_MODEL_NAME = "octavo-tiny"
API_KEY_ENV = "OCTAVO_API_KEY"
# prometheus-client's multiprocess folder (set by the --api-server-count supervisor, or by a
# user who runs several servers): /metrics then adds up every process's histograms.
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# --max-n's default: a request may take at most this fraction (1 / N) of the sequence slots.
DEFAULT_MAX_N_SHARE = 4
# From this cost per token the engine core takes every CPU core (default_model_threads): the
# 6x512 GPT-2 of the serving benchmark costs 42 MFLOP per token, its 1x16 twin 0.14, the
# embedded default model 2.6.
MIN_FLOPS_PER_TOKEN_FOR_ALL_CORES = 10_000_000
# --stream-batching-ms's default: Ray Serve LLM's own for the same purpose
# (RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS), 20 messages a second per stream.
DEFAULT_STREAM_BATCHING_MS = 50.0
# --api-server-count's most by default (default_api_server_count).
MAX_DEFAULT_API_SERVERS = 4

logger = logging.getLogger(__name__)


def add_engine_args(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """One flag per EngineConfig field (--max-num-seqs for max_num_seqs): the field's type,
    default, choices and help. A new engine setting is a new field, nothing here."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for config_field in dataclasses.fields(EngineConfig):
        flag = "--" + config_field.name.replace("_", "-")
        options: dict[str, Any] = {"help": config_field.metadata.get("help")}
        if "choices" in config_field.metadata:
            options["choices"] = list(config_field.metadata["choices"])
        kind = _flag_type(hints[config_field.name])
        if kind is bool:  # --name, and --no-name for a setting on (or decided) by default
            on_by_default = config_field.default is not False
            action = argparse.BooleanOptionalAction if on_by_default else "store_true"
            group.add_argument(flag, action=action, default=config_field.default, **options)
        elif config_field.name == "model":
            group.add_argument(
                flag, required=default_model is None, default=default_model, **options
            )
        else:
            group.add_argument(flag, type=kind, default=config_field.default, **options)


def _flag_type(hint: Any) -> type:
    """The argparse type of a field annotation: `int | None` parses as int."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _generate(args: argparse.Namespace) -> int:
    from octavo.engine import LLM, SamplingParams
    from octavo.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine(engine_config_from_args(args)))
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    for output in outputs:
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print(f"[{completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.ray:
        from octavo.server.ray_serve.launch import serve_on_ray

        return serve_on_ray(args)
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    api_servers = args.api_server_count or default_api_server_count(engine_config_from_args(args))
    if api_servers > 1:
        if args.inprocess_engine:
            raise ValueError("--api-server-count > 1 needs the engine core in its own process")
        from octavo.server.api_servers import serve_with_api_servers

        return serve_with_api_servers(args, api_servers)
    engine, app = build_server(args)
    return run_http_server(args, engine, app)


def run_http_server(
    args: argparse.Namespace,
    engine: AsyncEngine,
    app: FastAPI,
    sock: socket.socket | None = None,
    stop_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
) -> int:
    """Serves `app` with uvicorn on --host/--port (or on `sock`, already listening) until a
    stop signal drains it; the exit status: 1 if the engine core died, else 0."""
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # After the engine's grace and abort drain, connections still open (a stream nobody
        # reads) are closed: SIGTERM always ends the process.
        timeout_graceful_shutdown=args.shutdown_grace_seconds + ABORT_DRAIN_SECONDS + 1,
        http=http_with_header_timeout(args.header_timeout_seconds),
        limit_concurrency=args.limit_concurrency,
    )
    server = GracefulServer(uvicorn_config, engine, args.shutdown_grace_seconds, stop_signals)
    freeze_startup_heap()
    server.run(sockets=None if sock is None else [sock])
    if server.engine_failed:
        logger.error("the engine core died; exiting with status 1 so a supervisor restarts it")
        return 1
    return 0


def default_api_server_count(config: EngineConfig) -> int:
    """--api-server-count's default. On CPU one: the engine core's torch threads take the
    other cores. On CUDA the core needs one core for its host loop, and one API process
    streams a fraction of a GPU engine's tokens at one token per event (benchmarks/README,
    "Streaming at the engine's speed"); so as many as the cores allow beside the core's and
    one for the system, up to MAX_DEFAULT_API_SERVERS."""
    if config.torch_device.type != "cuda":
        return 1
    cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, cores - 2))


def build_server(
    args: argparse.Namespace, shared_core: SharedCore | None = None
) -> tuple[AsyncEngine, FastAPI]:
    """The engine (not started) and the app of `octavo serve`'s flags: what one server
    process runs, alone, as one of several API processes of a `shared_core`, or as a Ray
    Serve replica."""
    from octavo.server.app import create_app
    from octavo.server.chat_template import load_chat_template
    from octavo.server.serving_engine import ServerConfig

    engine_config = engine_config_from_args(args)
    # Before the engine starts: a bad template ends the command with its message.
    chat_template = load_chat_template(args.chat_template, args.model, args.load_format)
    model_threads = None
    if engine_config.torch_device.type == "cpu":
        model_threads = args.torch_threads or default_model_threads(engine_config)
    if shared_core is not None:
        torch.set_num_threads(1)  # this process runs no model: its torch work is tiny
        engine = AsyncEngine.sharing(engine_config, args.max_num_waiting, shared_core)
    elif args.inprocess_engine:
        if model_threads is not None:
            torch.set_num_threads(model_threads)
        engine = AsyncEngine.in_process(engine_config, args.max_num_waiting)
    else:
        torch.set_num_threads(1)  # this process runs no model: its torch work is tiny
        engine = AsyncEngine.multiprocess(engine_config, args.max_num_waiting, model_threads)
    name = args.served_model_name or (
        DEFAULT_MODEL_NAME if Path(args.model) == DEFAULT_MODEL else args.model
    )
    config = ServerConfig(
        served_model_name=name,
        model_root=str(args.model),
        api_key=_api_key(args.api_key),
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        max_n=args.max_n or max(1, engine_config.max_num_seqs // DEFAULT_MAX_N_SHARE),
        allowed_hosts=_allowed_hosts(args.allowed_hosts, args.host),
        chat_template=chat_template,
        metrics_dir=os.environ.get(PROMETHEUS_DIR_ENV),
    )
    return engine, create_app(engine, config)


def default_model_threads(config: EngineConfig) -> int:
    """The engine core's torch threads on CPU: every core for a model whose tokens cost far
    more than the API process's ~30 us of CPU per streamed token; all cores but one for a
    small one, whose token rate would keep a core of API work busy (and whose many short ops
    leave OpenMP threads spinning against it). Measured on 2 cores with
    benchmarks/serving_throughput.py (benchmarks/README.md): a 6x512 GPT-2 keeps 67% of
    offline throughput with 1 thread and 97-115% with 2; a 1x16 one 94% with 1 and 46% with 2.
    """
    cores = os.cpu_count() or 1
    model = load_model_config(config.model, config.load_format)
    if model.flops_per_token >= MIN_FLOPS_PER_TOKEN_FOR_ALL_CORES:
        return cores
    return max(1, cores - 1)


def _allowed_hosts(flag: str | None, bind_host: str) -> tuple[str, ...] | None:
    """--allowed-hosts as a tuple ("*" or None: any); by default the loopback names when
    bound to a loopback address (DNS rebinding), any host otherwise."""
    if flag is not None:
        hosts = tuple(h.strip() for h in flag.split(",") if h.strip())
        return None if "*" in hosts else hosts
    if bind_host in LOOPBACK_HOSTS or bind_host.startswith("127."):
        return (*LOOPBACK_HOSTS, bind_host)
    return None


def _api_key(flag: str | None) -> str | None:
    """--api-key, else $OCTAVO_API_KEY, else no auth; an empty key is refused (it would
    otherwise silently turn authentication off)."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"--api-key / ${API_KEY_ENV} must not be empty")
    return key


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains on SIGTERM or SIGINT, whether sent to this process alone
    or to its whole process group (systemd's KillMode=control-group, Ctrl-C; the engine core
    ignores both): admission stops, in-flight requests get `grace_seconds` to finish, the rest
    end with finish_reason "abort" (a stream still gets its finish event and [DONE]), the core
    is told to stop, and `run` returns, which `octavo serve` turns into status 0. A second
    signal ends the grace at once. A core that dies on its own stops the server too, with
    `engine_failed` set (status 1)."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        grace_seconds: float,
        stop_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
    ):
        """`stop_signals`: what drains the server (an API process of several drains on
        what its supervisor forwards, see api_servers.py)."""
        super().__init__(config)
        self.engine = engine
        self.grace_seconds = grace_seconds
        self.stop_signals = stop_signals
        self.engine_failed = False
        engine.on_fatal(self._engine_died)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """`handle_exit` on the stop signals while serving (signals reach the main thread
        only; elsewhere, as in a Ray replica, there is nothing to install)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.stop_signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _engine_died(self, exc: BaseException) -> None:
        """A step failed: every in-flight request already has its error; stop serving (a
        live process answering 503 forever helps nobody) and exit non-zero."""
        self.engine_failed = True
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's serve, then the engine's shutdown if the lifespan did not run it (uvicorn
        skips it when the startup fails): a core left running would keep this process from
        exiting, as multiprocessing ends its children at exit with a SIGTERM, which the core
        ignores, and then waits for them."""
        try:
            await super().serve(sockets)
        finally:
            await self.engine.shutdown(0.0)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM and SIGINT while serving: starts the engine's drain and uvicorn's shutdown
        (which waits for the streams to end, then runs the lifespan's `engine.shutdown`, the
        same drain); a repeated signal ends the grace at once.

        uvicorn's own handler is not called. It records the signal to raise it again once the
        server has shut down, so a drained server would die of it (SIGINT: asyncio's
        KeyboardInterrupt traceback) instead of exiting 0; and on a second Ctrl-C it stops
        waiting for open streams and skips the lifespan's shutdown instead of ending the
        grace."""
        grace = 0.0 if self.should_exit else self.grace_seconds
        self.should_exit = True
        # Installed only while `serve` runs on the loop, so the handler runs on its thread;
        # the drain is a task, started once the interrupted callback has returned.
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self.engine.shutdown(grace)))


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """`octavo serve --ray`: the same server as Ray Serve replicas behind one endpoint."""
    group = parser.add_argument_group("ray serve")
    group.add_argument(
        "--ray",
        action="store_true",
        help="serve through Ray Serve: --num-replicas engine replicas behind one OpenAI "
        "endpoint on --host/--port (needs the `ray` extra)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (default: $RAY_ADDRESS, else a running local instance, "
        "else a new local one)",
    )
    group.add_argument("--num-replicas", type=int, default=1, help="engine replicas")
    group.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale between --num-replicas and this many replicas on ongoing requests",
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling: ongoing requests per replica to aim for (default: max_num_seqs / 2)",
    )
    group.add_argument(
        "--routing",
        choices=["least-loaded", "prefix"],
        default="least-loaded",
        help="least-loaded: the less busy of two random replicas (power of two choices); "
        "prefix: the replica a prompt's prefix hashes to, unless it is busier than the "
        "least busy by more than --routing-imbalance",
    )
    group.add_argument(
        "--routing-imbalance",
        type=int,
        default=8,
        help="prefix routing: ongoing requests by which the prefix's replica may exceed the "
        "least busy one before load wins",
    )
    group.add_argument(
        "--stream-batching-ms",
        type=float,
        default=DEFAULT_STREAM_BATCHING_MS,
        help="a replica sends a stream's first two chunks at once, then one message per this "
        "many ms on average with every chunk made meanwhile (each message between Ray "
        "processes costs CPU, whatever its size); 0: each chunk as it comes",
    )
    group.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=None,
        help="CPUs Ray reserves per replica (default: the engine's torch threads on CPU, 1 "
        "on CUDA)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="Octavo GPT-2 inference")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve, default_model=str(DEFAULT_MODEL))
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--api-key", default=None, help=f"require this bearer key on /v1 (default: ${API_KEY_ENV})"
    )
    serve.add_argument(
        "--max-num-waiting",
        type=int,
        default=1024,
        help="requests allowed to wait for admission; more get 503",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument(
        "--chat-template",
        default=None,
        help="the Jinja chat template of /v1/chat/completions (transformers' "
        "chat_template semantics): a file, or the template itself (default: the "
        "checkpoint's tokenizer_config.json chat_template; GPT-2 has none)",
    )
    serve.add_argument(
        "--max-n",
        type=int,
        default=None,
        help="largest n / best_of per request (default: max_num_seqs / 4), so that one "
        "request cannot take every sequence slot",
    )
    serve.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names to answer ('*': any; default: the loopback names "
        "when bound to loopback, else any)",
    )
    serve.add_argument(
        "--header-timeout-seconds",
        type=float,
        default=10.0,
        help="close a connection that has not sent complete request headers by then",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=int,
        default=2048,
        help="connections and tasks at once; more are answered 503 by uvicorn",
    )
    serve.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM or SIGINT (to the server or its process group), time in-flight "
        "requests get before being aborted; a second signal aborts at once",
    )
    serve.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="CPU threads for the model in the engine core (default: every core for a "
        "model of >= 10 MFLOP per token, else all cores but one)",
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="API server processes in front of one engine core, accepting on the same port "
        "(each with its own event loop, detokenizer and SSE): for machines with cores to "
        "spare (default: 1 on CPU; on CUDA the cores beside the core's and one, up to "
        f"{MAX_DEFAULT_API_SERVERS})",
    )
    serve.add_argument(
        "--inprocess-engine",
        action="store_true",
        help="run the engine core in a thread of the API process instead of its own "
        "process (debugging; slower: both then share one GIL)",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    add_ray_args(serve)
    serve.set_defaults(handler=_serve)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    # The load-test client (and httpx, the `bench` extra) loads only when this runs; its
    # own parser reads the flags (`octavo bench serve --help` lists them).
    bench_serve = bench_commands.add_parser(
        "serve", add_help=False,
        help="load-test an OpenAI-compatible server (flags as vllm bench serve)",
    )  # fmt: skip
    bench_serve.set_defaults(handler=_bench_serve, takes_extra_args=True)

    generate = commands.add_parser("generate", help="complete prompts offline and print them")
    add_engine_args(generate)
    generate.add_argument("prompts", nargs="+", help="prompt text(s)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--n", type=int, default=1)
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=None)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.set_defaults(handler=_generate)
    return parser


def _bench_serve(args: argparse.Namespace) -> int:
    try:
        from octavo.benchmarks import load_test
    except ModuleNotFoundError as exc:
        print(
            f"octavo: error: `octavo bench serve` needs {exc.name}: pip install 'octavo[bench]'",
            file=sys.stderr,
        )
        return 2
    return load_test.run(load_test.build_parser().parse_args(args.extra_args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    try:
        return args.handler(args)
    except ValueError as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
