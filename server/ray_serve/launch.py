"""Builds the Ray Serve application from `ServerArgs`, and runs it.

`octavo serve --ray ...` calls `serve_on_ray`; `serve run` / `serve deploy` with a config
file call `app_builder` (its `args` are the same flags, by name: `{"model": "gpt2",
"num_replicas": 2}`, read by `ServerArgs.from_config`), so both mean exactly what
`octavo serve` means.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig

from octavo.engine.core.core_process import SERVER_STOP_SIGNALS
from octavo.server.ray_serve.deployments import EngineReplica, Ingress
from octavo.server.ray_serve.routing import PrefixAffinityRouter
from octavo.server.server_args import ServerArgs

logger = logging.getLogger(__name__)

APP_NAME = "octavo"
# The ingress only forwards bytes: it reserves no CPU, so N one-CPU replicas fit N cores.
INGRESS_CPUS = 0


def build_app(args: ServerArgs) -> Application:
    """The ingress bound to `--num-replicas` engine replicas (or autoscaling up to
    `--max-replicas`), each reserving one GPU on CUDA or its CPUs on CPU. ValueError: Ray
    settings that cannot run."""
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if args.max_replicas is not None and args.max_replicas < args.num_replicas:
        raise ValueError("--max-replicas must be >= --num-replicas")
    if not args.stream_batching_ms >= 0:
        raise ValueError(f"--stream-batching-ms must be >= 0, got {args.stream_batching_ms}")
    config = args.engine
    cuda = config.device_type == "cuda"
    cpus = args.num_cpus_per_replica
    if cpus is None:
        cpus = 1 if cuda else (args.torch_threads or 1)
    # --log-level applies to Ray Serve's replica logs too; per-request access logs only at
    # info and debug, as uvicorn writes them for `octavo serve`.
    logging_config = {
        "log_level": args.log_level.upper(),
        "enable_access_log": args.log_level in ("debug", "info"),
    }
    options: dict[str, Any] = {
        # A replica may run every sequence its engine admits plus every waiting one; past
        # that the engine answers 503 itself, so Ray Serve's queue cap must not be tighter.
        "max_ongoing_requests": config.max_num_seqs + args.max_num_waiting,
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": 1 if cuda else 0},
        # A replica loads its model and starts its core before it is healthy.
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": args.shutdown_grace_seconds + 5,
        "logging_config": logging_config,
    }
    if args.max_replicas is not None and args.max_replicas > args.num_replicas:
        target = args.target_ongoing_requests or max(1.0, config.max_num_seqs / 2)
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=args.num_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=target,
        )
    else:
        options["num_replicas"] = args.num_replicas
    if args.routing == "prefix":
        options["request_router_config"] = {
            "request_router_class": f"{PrefixAffinityRouter.__module__}.PrefixAffinityRouter",
            "request_router_kwargs": {"imbalance": args.routing_imbalance},
        }
    replicas = serve.deployment()(EngineReplica).options(**options).bind(args)
    ingress = serve.deployment()(Ingress).options(
        max_ongoing_requests=args.limit_concurrency,
        ray_actor_options={"num_cpus": INGRESS_CPUS},
        logging_config=logging_config,
    )
    return ingress.bind(replicas, args.max_body_bytes)


def app_builder(config: dict[str, Any]) -> Application:
    """`serve run octavo.server.ray_serve.launch:app_builder model=gpt2 num_replicas=2`, or a
    config file's `args`: each key an `octavo serve` flag (underscores or dashes), each value
    its argument (`ServerArgs.from_config`). ValueError: an unknown key or a bad value,
    named."""
    return build_app(ServerArgs.from_config(config))


def serve_on_ray(args: ServerArgs) -> int:
    """Joins (or starts) Ray, serves the app on --host/--port until SIGINT or SIGTERM, then
    shuts it down (in-flight requests get --shutdown-grace-seconds)."""
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(
        http_options={"host": args.host, "port": args.port},
        logging_config={"log_level": args.log_level.upper()},
    )
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    logger.info(
        "serving %s on http://%s:%d through Ray Serve", args.engine.model, args.host, args.port
    )
    stop = threading.Event()
    for sig in SERVER_STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    if started_here:
        serve.shutdown()
        ray.shutdown()
    return 0
