"""ServerArgs is `octavo serve`'s configuration: its flags are its fields (and those of the
EngineConfig it holds), a Serve config's `args` read into the same object field by field, and
it is frozen, hashable and picklable, as what crosses into API processes and Ray replicas."""

import argparse
import dataclasses
import pickle
import subprocess
import sys

import pytest

from octavo.engine.config import EngineConfig
from octavo.server.cli import build_parser, main
from octavo.server.server_args import DEFAULT_MODEL, ServerArgs


def serve_parser() -> argparse.ArgumentParser:
    """The `octavo serve` subcommand's parser, as `octavo` builds it."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def parse(*argv: str) -> ServerArgs:
    return ServerArgs.from_cli_args(build_parser().parse_args(["serve", *argv]))


def field_names() -> set[str]:
    """Every setting by name: ServerArgs' own fields and those of its EngineConfig."""
    own = {f.name for f in dataclasses.fields(ServerArgs) if f.name != "engine"}
    return own | {f.name for f in dataclasses.fields(EngineConfig)}


def test_a_command_line_parses_to_the_expected_server_args():
    args = parse(
        "--model", "m", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--enforce-eager",
        "--port", "9001", "--api-key", "k", "--max-n", "3", "--header-timeout-seconds", "2.5",
        "--inprocess-engine", "--log-level", "warning", "--ray", "--routing", "prefix",
        "--stream-batching-ms", "0", "--num-cpus-per-replica", "0.5",
    )  # fmt: skip
    engine = EngineConfig(
        model="m", max_num_seqs=7, enable_prefix_caching=False, enforce_eager=True
    )
    assert args == ServerArgs(
        engine=engine,
        port=9001,
        api_key=("k",),
        max_n=3,
        header_timeout_seconds=2.5,
        inprocess_engine=True,
        log_level="warning",
        ray=True,
        routing="prefix",
        stream_batching_ms=0.0,
        num_cpus_per_replica=0.5,
    )
    assert isinstance(args.stream_batching_ms, float) and isinstance(args.port, int)


def test_no_flags_is_the_default_server_args_on_the_embedded_model():
    assert parse() == ServerArgs()
    assert ServerArgs().engine == EngineConfig(model=str(DEFAULT_MODEL))


def test_every_flag_is_a_field_and_every_field_a_flag_with_its_default():
    actions = [a for a in serve_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert sorted(a.dest for a in actions) == sorted(field_names())
    defaults = ServerArgs()
    for action in actions:
        assert action.option_strings[0] == "--" + action.dest.replace("_", "-")
        owner = defaults.engine if hasattr(defaults.engine, action.dest) else defaults
        assert action.default == getattr(owner, action.dest), action.dest


def test_choices_come_from_the_field_types():
    with pytest.raises(SystemExit):
        parse("--routing", "random")
    with pytest.raises(SystemExit):
        parse("--log-level", "verbose")
    with pytest.raises(SystemExit):
        parse("--dtype", "float8")


def test_server_args_are_frozen_hashable_and_survive_pickle():
    args = parse("--port", "9001", "--max-num-seqs", "7")
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.port = 1  # type: ignore[misc]
    assert hash(args) == hash(parse("--port", "9001", "--max-num-seqs", "7"))
    assert args != ServerArgs() and len({args, ServerArgs()}) == 2
    assert pickle.loads(pickle.dumps(args)) == args


def test_a_serve_config_reads_into_what_the_same_flags_parse_to():
    config = {
        "model": "gpt2",
        "num-replicas": 2,  # dashes or underscores
        "max_replicas": "4",  # `serve run app:builder max_replicas=4` passes strings
        "routing": "prefix",
        "enforce_eager": True,
        "enable_prefix_caching": "false",
        "stream_batching_ms": 0,
        "allowed_hosts": "*",
        "max_n": None,  # null: the default
    }
    assert ServerArgs.from_config(config) == parse(
        "--model", "gpt2", "--num-replicas", "2", "--max-replicas", "4", "--routing", "prefix",
        "--enforce-eager", "--no-enable-prefix-caching", "--stream-batching-ms", "0",
        "--allowed-hosts", "*",
    )  # fmt: skip
    assert ServerArgs.from_config({}) == ServerArgs()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_replicas": 2, "no_such_flag": 1}, "unknown option 'no_such_flag'"),
        ({"port": "http"}, "'port' must be int, got 'http'"),
        ({"port": 80.5}, "'port' must be int"),
        ({"max_num_seqs": True}, "'max_num_seqs' must be int, got True"),
        ({"ray": "maybe"}, "'ray' must be bool"),
        ({"routing": "random"}, "'routing' must be one of \\['least-loaded', 'prefix'\\]"),
        ({"dtype": "float8"}, "'dtype' must be one of"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),  # EngineConfig's own check
        ({"prefill_interval": 0}, "prefill_interval must be >= 1, got 0"),
    ],
)
def test_a_bad_serve_config_is_refused_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_config(config)


def test_a_setting_the_engine_refuses_is_status_2_with_its_message(capsys):
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err == "octavo: error: max_num_seqs must be >= 1, got 0\n"


def test_flags_parse_and_a_bad_setting_fails_without_loading_torch():
    """`octavo serve --help` and a bad flag answer at once: torch (seconds to import) loads
    only once a server starts. Run in a fresh interpreter, as the command runs."""
    program = (
        "import sys; from octavo.server.cli import main; "
        "status = main(['serve', '--block-size', '3']); "
        "print(status, 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    assert "block_size must be a power of two" in run.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"], "--tool-call-parser"),
    ],
)
def test_auto_tool_choice_flags_are_checked_at_start(capsys, flags, message):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_per_user_waiting_limit_below_one_is_refused_at_start(capsys, value):
    assert main(["serve", "--max-num-waiting-per-user", value]) == 2
    message = f"--max-num-waiting-per-user must be >= 1, got {value}"
    assert capsys.readouterr().err == f"octavo: error: {message}\n"


@pytest.mark.parametrize(
    ("flags", "has_template", "parser"),
    [
        ([], True, "hermes"),  # the embedded model with its checkpoint's template
        (["--model", str(DEFAULT_MODEL / ".." / "default_model")], True, "hermes"),
        ([], False, None),  # a checkpoint without one
        (["--chat-template", "{{ messages }}"], True, None),  # the user's template: vLLM's rule
        (["--model", "gpt2", "--load-format", "dummy"], True, None),
        (["--model", "gpt2", "--load-format", "dummy", "--enable-auto-tool-choice",
          "--tool-call-parser", "hermes"], False, "hermes"),
    ],
)  # fmt: skip
def test_auto_tool_choice_is_on_for_the_embedded_model_alone(flags, has_template, parser):
    from octavo.server.launch import _tool_call_parser

    args = ServerArgs.from_cli_args(build_parser().parse_args(["serve", *flags]))
    assert _tool_call_parser(args, has_template) == parser


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules", "a=/tmp"], "need --enable-lora"),
        (["--allow-runtime-lora-updating"], "need --enable-lora"),
        (["--enable-lora", "--lora-modules", "no-path"], "NAME=PATH or JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "JSON needs name and path"),
        (["--enable-lora", "--lora-modules", "a=/nowhere/at/all"], "is not a folder"),
        (["--enable-lora", "--allow-runtime-lora-updating", "--api-server-count", "2"],
         "one API server process"),  # each would keep its own adapters
    ],
)  # fmt: skip
def test_lora_flags_are_checked_at_start(capsys, flags, message):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_lora_modules_take_several_values():
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    )
    server_args = ServerArgs.from_cli_args(args)
    assert server_args.lora_modules == ("a=/x", '{"name": "b", "path": "/y"}')
