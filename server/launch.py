"""From `ServerArgs` to a running server: the engine, the app and the uvicorn server of
`octavo serve`, the defaults that depend on the machine or the model (API processes, the
engine core's torch threads, --max-n, allowed hosts), and the choice between one process,
--api-server-count processes and Ray Serve."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from octavo.engine.config import EngineConfig
from octavo.engine.core.core_process import SERVER_STOP_SIGNALS
from octavo.engine.frontend.async_engine import ABORT_DRAIN_SECONDS, AsyncEngine
from octavo.engine.frontend.core_client import SharedCore
from octavo.engine.heap import tune_collector_for_serving
from octavo.engine.worker.models.model_files import load_model_config
from octavo.server.graceful_server import GracefulServer
from octavo.server.http_guards import LOOPBACK_HOSTS, http_with_header_timeout
from octavo.server.lora_modules import LoRAModules
from octavo.server.server_args import (
    API_KEY_ENV,
    DEFAULT_MAX_N_SHARE,
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_TOOL_CALL_PARSER,
    MAX_DEFAULT_API_SERVERS,
    MIN_FLOPS_PER_TOKEN_FOR_ALL_CORES,
    ServerArgs,
)

# prometheus-client's multiprocess folder (set by the --api-server-count supervisor, or by a
# user who runs several servers): /metrics then adds up every process's histograms.
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

logger = logging.getLogger(__name__)


def launch_server(args: ServerArgs) -> int:
    """`octavo serve`: runs the server `args` describe until it is stopped; the exit status
    (0: drained cleanly; 1: the engine core died). ValueError: a setting that cannot run."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = args.engine
    logger.info(
        "serving %s: max_num_seqs %d, max_num_batched_tokens %d, scheduling policy %s",
        config.model, config.max_num_seqs, config.max_num_batched_tokens,
        config.scheduling_policy,
    )  # fmt: skip
    per_user = args.max_num_waiting_per_user
    if per_user is not None and per_user < 1:
        raise ValueError(f"--max-num-waiting-per-user must be >= 1, got {per_user}")
    if args.ray:
        from octavo.server.ray_serve.launch import serve_on_ray

        return serve_on_ray(args)
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    api_servers = args.api_server_count or default_api_server_count(args.engine)
    if api_servers == 1:
        return run_http_server(args)
    if args.allow_runtime_lora_updating:
        raise ValueError(
            "--allow-runtime-lora-updating needs one API server process: each would keep "
            "its own adapters (--api-server-count 1)"
        )
    if args.inprocess_engine:
        raise ValueError("--api-server-count > 1 needs the engine core in its own process")
    from octavo.server.api_servers import serve_with_api_servers

    return serve_with_api_servers(args, api_servers)


def run_http_server(
    args: ServerArgs,
    shared_core: SharedCore | None = None,
    sock: socket.socket | None = None,
    stop_signals: tuple[int, ...] = SERVER_STOP_SIGNALS,
) -> int:
    """Serves the app of `args` (`build_server`, over `shared_core` if given) with uvicorn
    on --host/--port (or on `sock`, already listening) until a stop signal drains it; the
    exit status: 1 if the engine core died, else 0."""
    engine, app = build_server(args, shared_core)
    # After the engine's grace and abort drain, connections still open (a stream nobody
    # reads) are closed: SIGTERM always ends the process.
    close_after_s = args.shutdown_grace_seconds + ABORT_DRAIN_SECONDS + 1
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Annotated int, but handed to asyncio.wait_for, which takes fractional seconds.
        timeout_graceful_shutdown=close_after_s,  # type: ignore[arg-type]
        http=http_with_header_timeout(args.header_timeout_seconds),
        limit_concurrency=args.limit_concurrency,
    )
    server = GracefulServer(uvicorn_config, engine, args.shutdown_grace_seconds, stop_signals)
    server.run(sockets=None if sock is None else [sock])
    if server.engine_failed:
        logger.error("the engine core died; exiting with status 1 so a supervisor restarts it")
        return 1
    return 0


def build_server(
    args: ServerArgs, shared_core: SharedCore | None = None
) -> tuple[AsyncEngine, FastAPI]:
    """The engine (not started) and the app of `args`: what one server process runs, alone,
    as one of several API processes of a `shared_core`, or as a Ray Serve replica; the
    process's collector is then set up for serving, with them in its frozen heap."""
    from octavo.server.app import create_app
    from octavo.server.chat_template import load_chat_template
    from octavo.server.serving_engine import ServerConfig

    engine_config = args.engine
    # Before the engine starts: a bad template or key ends the command with its message.
    chat_template = load_chat_template(
        args.chat_template, engine_config.model, engine_config.load_format
    )
    model = engine_config.model
    name = args.served_model_name or (DEFAULT_MODEL_NAME if _serves_default_model(args) else model)
    config = ServerConfig(
        served_model_name=name,
        model_root=str(model),
        api_keys=api_keys_of(args.api_key, args.api_key_file),
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        max_n=args.max_n or max(1, engine_config.max_num_seqs // DEFAULT_MAX_N_SHARE),
        allowed_hosts=_allowed_hosts(args.allowed_hosts, args.host),
        chat_template=chat_template,
        tool_call_parser=_tool_call_parser(args, chat_template is not None),
        lora=_lora_modules(args, name),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        metrics_dir=os.environ.get(PROMETHEUS_DIR_ENV),
    )
    threads = model_threads(args)
    per_user = args.max_num_waiting_per_user
    # An API process runs no model and imports no torch; only an engine core does.
    if shared_core is not None:
        engine = AsyncEngine.sharing(engine_config, args.max_num_waiting, shared_core, per_user)
    elif args.inprocess_engine:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        engine = AsyncEngine.in_process(engine_config, args.max_num_waiting, per_user)
    else:
        engine = AsyncEngine.multiprocess(engine_config, args.max_num_waiting, threads, per_user)
    app = create_app(engine, config)
    tune_collector_for_serving()
    return engine, app


def _lora_modules(args: ServerArgs, base_name: str) -> LoRAModules | None:
    """The adapters served by name (--enable-lora), each --lora-modules entry checked
    against the base (ValueError naming it); None without --enable-lora."""
    from octavo.server.errors import APIError
    from octavo.server.lora_modules import LoRAModulePath

    engine = args.engine
    if not engine.enable_lora:
        if args.lora_modules or args.allow_runtime_lora_updating:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        return None
    modules = LoRAModules(
        base_name, load_model_config(engine.model, engine.load_format), engine.max_lora_rank
    )
    for value in args.lora_modules or ():
        entry = LoRAModulePath.parse(value)
        try:
            modules.add(entry.name, entry.path)
        except APIError as exc:
            raise ValueError(f"--lora-modules {value!r}: {exc.message}") from None
    return modules


def _serves_default_model(args: ServerArgs) -> bool:
    return Path(args.engine.model).resolve() == DEFAULT_MODEL.resolve()


def _tool_call_parser(args: ServerArgs, has_template: bool) -> str | None:
    """The parser of tool_choice "auto": --tool-call-parser, which --enable-auto-tool-choice
    needs (vLLM's rule); None without --enable-auto-tool-choice. The embedded model, served
    with its checkpoint's own template (`has_template`, no --chat-template), is trained to
    write Hermes calls: "auto" works on it with no flag. ValueError naming a flag."""
    from octavo.server.tool_calls import TOOL_CALL_PARSERS

    parser = args.tool_call_parser
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}")
    if args.enable_auto_tool_choice:
        if parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
        return parser
    embedded = _serves_default_model(args) and args.chat_template is None and has_template
    return DEFAULT_MODEL_TOOL_CALL_PARSER if embedded else None


def default_api_server_count(config: EngineConfig) -> int:
    """--api-server-count's default. On CPU one: the engine core's torch threads take the
    other cores. On CUDA the core needs one core for its host loop, and one API process
    streams a fraction of a GPU engine's tokens at one token per event (docs/benchmarks/history.md,
    "Streaming at the engine's speed"); so as many as the cores allow beside the core's and
    one for the system, up to MAX_DEFAULT_API_SERVERS."""
    if config.device_type != "cuda":
        return 1
    cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, cores - 2))


def model_threads(args: ServerArgs) -> int | None:
    """The engine core's torch threads: --torch-threads; by default on CPU every core for a
    model whose tokens cost far more than the API process's CPU per streamed token, all
    cores but one for a small one, whose token rate would keep a core of API work busy (and
    whose many short ops leave OpenMP threads spinning against it); None on CUDA (the device
    runs the model). The default was chosen with benchmarks/serving_throughput.py on 2
    cores; the figures are in docs/benchmarks/history.md."""
    config = args.engine
    if config.device_type != "cpu":
        return None
    if args.torch_threads:
        return args.torch_threads
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


def api_keys_of(flag: tuple[str, ...] | None, key_file: str | None) -> dict[str, str] | None:
    """Each accepted key and the user it stands for: --api-key's keys (else
    $OCTAVO_API_KEY's), named key0, key1, ..., and --api-key-file's; None: no auth. An
    empty key is refused (it would otherwise silently turn authentication off), as are a
    key or a name given twice."""
    env = os.environ.get(API_KEY_ENV)
    keys = flag if flag is not None else (() if env is None else (env,))
    named = [(f"key{i}", key) for i, key in enumerate(keys)]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {exc}") from None
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) > 2:
                raise ValueError(f"--api-key-file {key_file}:{number}: expected KEY or NAME KEY")
            name = fields[0] if len(fields) == 2 else f"key{len(named)}"
            named.append((name, fields[-1]))
    if not named:
        return None
    if any(not key.strip() for _, key in named):
        raise ValueError(f"--api-key / ${API_KEY_ENV} must not be empty")
    users = {key: name for name, key in named}
    if len(users) < len(named) or len({*users.values()}) < len(named):
        raise ValueError("--api-key / --api-key-file: a key or a name is given twice")
    return users
