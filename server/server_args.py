"""`ServerArgs`: every setting of `octavo serve`, typed, with its default and help.

The one definition of the server's options: `octavo serve`'s flags are generated from these
fields (and from the `EngineConfig` fields of `engine`, see dataclass_flags.py), a Ray Serve
config's `args` are read into it field by field, and what runs a server (launch.py, the
--api-server-count processes, the Ray Serve replicas) receives it. It is frozen, hashable and
picklable, so it crosses process boundaries as it is.

Settings whose default depends on the machine or the model (--max-n, --torch-threads,
--api-server-count, --allowed-hosts, --api-key's environment variable) stay None here and
are resolved where the server starts (launch.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from octavo.engine.config import EngineConfig
from octavo.server.dataclass_flags import add_flags, config_values, from_flags

# The tiny GPT-2 trained on Python's reference text (tools/train_default_model.py).
DEFAULT_MODEL = Path(__file__).parent / "default_model"
DEFAULT_MODEL_NAME = "octavo-tiny-chat"
# A chat template of the embedded checkpoint writes tools and calls in the Hermes format.
DEFAULT_MODEL_TOOL_CALL_PARSER = "hermes"
API_KEY_ENV = "OCTAVO_API_KEY"
# --max-n's default: a request may take at most this fraction (1 / N) of the sequence slots.
DEFAULT_MAX_N_SHARE = 4
# From this cost per token the engine core takes every CPU core (launch.model_threads):
# the 6x512 GPT-2 of the serving benchmark costs 42 MFLOP per token, its 1x16 twin 0.14, the
# embedded default model 8.4.
MIN_FLOPS_PER_TOKEN_FOR_ALL_CORES = 10_000_000
# --api-server-count's most by default (launch.default_api_server_count).
MAX_DEFAULT_API_SERVERS = 4


def _ray(default: Any, help: str) -> Any:
    """A field listed under `octavo serve --help`'s Ray Serve section."""
    return field(default=default, metadata={"help": help, "group": "ray serve"})


def _option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerArgs:
    """What `octavo serve` is asked to run. Each field is the flag of its name
    (`--max-num-waiting` for max_num_waiting), and so is each field of `engine`; the
    defaults here are the flags' defaults (`engine`'s model: the embedded default model).

    Values are checked where they are used, as the flags always were: `engine` by
    EngineConfig itself, the Ray settings by the Ray Serve app, the rest when the server
    starts (a ValueError each, which `octavo` reports with status 2)."""

    engine: EngineConfig = field(
        default=EngineConfig(model=str(DEFAULT_MODEL)), metadata={"group": "engine"}
    )
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: tuple[str, ...] | None = _option(
        None,
        f"require one of these bearer keys on /v1 (default: ${API_KEY_ENV}); with several, "
        "each key is a user of --scheduling-policy fair (key0, key1, ... in /metrics)",
    )
    api_key_file: str | None = _option(
        None,
        "more keys, one a line: KEY, or NAME KEY to name the user it stands for (in /metrics "
        "and the fair policy); blank lines and lines starting with # are skipped",
    )
    max_num_waiting: int = _option(1024, "requests allowed to wait for admission; more get 503")
    max_num_waiting_per_user: int | None = _option(
        None,
        "requests one user (its API key, or its `user` field without keys) may have waiting "
        "for admission; more get 429 with Retry-After (default: no bound but "
        "--max-num-waiting)",
    )
    max_body_bytes: int = 4 << 20
    chat_template: str | None = _option(
        None,
        "the Jinja chat template of /v1/chat/completions (transformers' chat_template "
        "semantics): a file, or the template itself (default: the checkpoint's "
        "tokenizer_config.json chat_template; GPT-2 has none)",
    )
    enable_auto_tool_choice: bool = _option(
        False,
        'answer tool_choice "auto" (the default when a request has tools): the model decides '
        "whether to call a tool, and --tool-call-parser finds the calls in its text; without "
        'it, "auto" with tools is a 400 (forced calls, a named function or "required", work '
        "on any model without it); the embedded default model, when its checkpoint has a "
        'chat template (one trained to write Hermes calls), answers "auto" without it',
    )
    tool_call_parser: str | None = _option(
        None,
        "how tool calls appear in the model's text, with --enable-auto-tool-choice: hermes "
        '(<tool_call>{"name": ..., "arguments": ...}</tool_call>)',
    )
    lora_modules: tuple[str, ...] | None = _option(
        None,
        "with --enable-lora: the LoRA adapters served, each by its name as a request's model: "
        'NAME=PATH or JSON {"name": ..., "path": ..., "base_model_name": ...}',
    )
    allow_runtime_lora_updating: bool = _option(
        False,
        "with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and "
        "remove adapters while serving (a client then names folders the server reads: off "
        "by default); one API server process only",
    )
    max_n: int | None = _option(
        None,
        f"largest n / best_of per request (default: max_num_seqs / {DEFAULT_MAX_N_SHARE}), so "
        "that one request cannot take every sequence slot",
    )
    allowed_hosts: str | None = _option(
        None,
        "comma-separated Host names to answer ('*': any; default: the loopback names when "
        "bound to loopback, else any)",
    )
    header_timeout_seconds: float = _option(
        10.0, "close a connection that has not sent complete request headers by then"
    )
    limit_concurrency: int = _option(
        2048, "connections and tasks at once; more are answered 503 by uvicorn"
    )
    shutdown_grace_seconds: float = _option(
        10.0,
        "on SIGTERM or SIGINT (to the server or its process group), time in-flight requests "
        "get before being aborted; a second signal aborts at once",
    )
    torch_threads: int | None = _option(
        None,
        "CPU threads for the model in the engine core (default: every core for a model of "
        f">= {MIN_FLOPS_PER_TOKEN_FOR_ALL_CORES // 1_000_000} MFLOP per token, else all "
        "cores but one)",
    )
    api_server_count: int | None = _option(
        None,
        "API server processes in front of one engine core, accepting on the same port (each "
        "with its own event loop, detokenizer and SSE): for machines with cores to spare "
        "(default: 1 on CPU; on CUDA the cores beside the core's and one, up to "
        f"{MAX_DEFAULT_API_SERVERS})",
    )
    inprocess_engine: bool = _option(
        False,
        "run the engine core in a thread of the API process instead of its own process "
        "(debugging; slower: both then share one GIL)",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    ray: bool = _ray(
        False,
        "serve through Ray Serve: --num-replicas engine replicas behind one OpenAI endpoint "
        "on --host/--port (needs the `ray` extra)",
    )
    ray_address: str | None = _ray(
        None,
        "join this Ray cluster (default: $RAY_ADDRESS, else a running local instance, else a "
        "new local one)",
    )
    num_replicas: int = _ray(1, "engine replicas")
    max_replicas: int | None = _ray(
        None, "autoscale between --num-replicas and this many replicas on ongoing requests"
    )
    target_ongoing_requests: float | None = _ray(
        None, "autoscaling: ongoing requests per replica to aim for (default: max_num_seqs / 2)"
    )
    routing: Literal["least-loaded", "prefix"] = _ray(
        "least-loaded",
        "least-loaded: the less busy of two random replicas (power of two choices); prefix: "
        "the replica a prompt's prefix hashes to, unless it is busier than the least busy by "
        "more than --routing-imbalance",
    )
    routing_imbalance: int = _ray(
        8,
        "prefix routing: ongoing requests by which the prefix's replica may exceed the least "
        "busy one before load wins",
    )
    # Ray Serve LLM's own default for the same purpose (RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS):
    # 20 messages a second per stream.
    stream_batching_ms: float = _ray(
        50.0,
        "a replica sends a stream's first two chunks at once, then one message per this many "
        "ms on average with every chunk made meanwhile (each message between Ray processes "
        "costs CPU, whatever its size); 0: each chunk as it comes",
    )
    num_cpus_per_replica: float | None = _ray(
        None,
        "CPUs Ray reserves per replica (default: the engine's torch threads on CPU, 1 on CUDA)",
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Adds `octavo serve`'s flags, one per field, with the fields' defaults and help."""
        add_flags(parser, cls, cls())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """The ServerArgs of a namespace parsed by a parser that `add_cli_args` made (other
        attributes, such as the subcommand's, are ignored). ValueError: an engine setting
        EngineConfig refuses."""
        return from_flags(cls, vars(args))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ServerArgs:
        """The ServerArgs of a Ray Serve config's `args` (`{"model": "gpt2",
        "num_replicas": 2}`): each key an `octavo serve` flag by name (underscores or
        dashes), each value its argument (a bool for an on/off flag, null for the default).
        ValueError: an unknown key or a value of the wrong type (naming the key), or an
        engine setting EngineConfig refuses."""
        return from_flags(cls, config_values(cls, config, "Serve config"))
