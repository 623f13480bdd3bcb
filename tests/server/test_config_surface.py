"""EngineConfig is the one source of the engine's settings: every field
is a CLI flag with the field's default, and a keyword of the offline LLM."""

import dataclasses
import os
import subprocess
import sys

import pytest

from octavo import LLM, EngineConfig
from octavo.engine.config import GRAPH_PREFILL_INTERVAL
from octavo.server.cli import build_parser
from octavo.server.dataclass_flags import from_flags
from octavo.server.server_args import ServerArgs

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def engine_config_from_args(args) -> EngineConfig:
    """What `octavo serve` or `octavo generate` runs the engine with."""
    if args.command == "serve":
        return ServerArgs.from_cli_args(args).engine
    return from_flags(EngineConfig, vars(args))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_field_is_a_flag_with_its_default(command, capsys):
    argv = [command] if command == "serve" else [command, "--model", "m", "hello"]
    args = build_parser().parse_args(argv)
    # serve defaults to the embedded model; every other field to EngineConfig's default.
    assert engine_config_from_args(args) == EngineConfig(model=args.model)
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in help_text, name


def test_flags_parse_to_the_fields():
    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", "7", "--enforce-eager", "--kv-cache-gb", "0.5",
         "--num-blocks", "64", "--dtype", "float32", "--attention-backend", "torch"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert (config.max_num_seqs, config.enforce_eager, config.kv_cache_gb) == (7, True, 0.5)
    assert (config.num_blocks, config.dtype, config.attention_backend) == (64, "float32", "torch")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float8"])  # choices come from the field
    # A setting on by default is turned off with --no-...
    assert config.enable_prefix_caching
    off = build_parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert not engine_config_from_args(off).enable_prefix_caching


def test_llm_takes_every_field_by_keyword(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", num_blocks=64, max_num_seqs=3, block_size=8)
    config = llm.engine.config
    assert (config.num_blocks, config.max_num_seqs, config.block_size) == (64, 3, 8)
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(tiny_model_dir, max_num_sequences=3)


def test_the_octavo_package_lazily_re_exports_exactly_the_engine_api():
    import octavo
    import octavo.engine

    assert sorted(octavo.__all__) == sorted(octavo.engine.__all__)
    assert all(getattr(octavo, name) is getattr(octavo.engine, name) for name in octavo.__all__)


@pytest.mark.parametrize(
    ("settings", "graph_interval"),
    [
        ({"device": "cuda"}, True),
        ({"device": "cuda:1", "dtype": "float32"}, True),
        ({"device": "cuda", "enforce_eager": True}, False),
        ({"device": "cuda", "attention_backend": "torch"}, False),
        ({"device": "cpu"}, False),
        ({"device": "cpu", "attention_backend": "triton"}, False),
    ],
)
def test_the_prefill_interval_defaults_to_the_graph_interval_only_where_graphs_replay(
    settings, graph_interval
):
    """Decode-only steps pay only where CUDA graphs replay them; elsewhere admissions are
    not held back. A value given is kept either way."""
    config = EngineConfig(model="m", **settings)
    assert config.uses_cuda_graphs is graph_interval
    assert config.effective_prefill_interval == (GRAPH_PREFILL_INTERVAL if graph_interval else 1)
    for given in (1, 3):
        given_config = EngineConfig(model="m", prefill_interval=given, **settings)
        assert given_config.effective_prefill_interval == given


@pytest.mark.parametrize(
    "settings",
    [{"device": "cpu"}, {"device": "cuda", "enforce_eager": True},
     {"device": "cuda", "attention_backend": "torch"}],
)  # fmt: skip
def test_piecewise_graphs_without_cuda_graphs_are_refused_naming_the_field(settings):
    with pytest.raises(ValueError, match="piecewise_cuda_graphs needs CUDA graphs"):
        EngineConfig(model="m", piecewise_cuda_graphs=True, **settings)
    assert EngineConfig(model="m", device="cuda", piecewise_cuda_graphs=True).uses_cuda_graphs
    assert not EngineConfig(model="m", **settings).uses_piecewise_graphs


def test_piecewise_graphs_default_on_with_cuda_graphs_and_can_be_turned_off():
    assert EngineConfig(model="m", device="cuda").uses_piecewise_graphs
    assert not EngineConfig(
        model="m", device="cuda", piecewise_cuda_graphs=False
    ).uses_piecewise_graphs


@pytest.mark.parametrize("gpu_library", [None, "libtorch_cuda.so", "libtorch_hip.so"])
def test_device_auto_is_cpu_without_importing_a_torch_built_for_no_gpu(tmp_path, gpu_library):
    """An API process learns the device type of `--device auto` without torch when the
    installed torch has no GPU library (its torch.cuda.is_available() is always False);
    with one, only torch can tell. A stand-in torch package that fails when imported shows
    which happened."""
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (lib / "libtorch_cpu.so").touch()
    if gpu_library is not None:
        (lib / gpu_library).touch()
    program = "from octavo.engine.config import EngineConfig; print(EngineConfig('m').device_type)"
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    if gpu_library is None:
        assert (run.returncode, run.stdout) == (0, "cpu\n"), run.stderr
    else:
        assert run.returncode != 0 and "torch was imported" in run.stderr
