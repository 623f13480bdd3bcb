"""The `octavo` command line: the only place arguments are read. It parses, then hands
`octavo serve` a `ServerArgs` (launch.py runs it), `octavo generate` an `EngineConfig`, and
`octavo bench serve` its own flags."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from octavo.engine.config import EngineConfig
from octavo.server.dataclass_flags import add_flags, from_flags
from octavo.server.server_args import ServerArgs


def _generate(args: argparse.Namespace) -> int:
    from octavo.engine import LLM, SamplingParams
    from octavo.engine.frontend.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine(from_flags(EngineConfig, vars(args))))
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
    for output in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print(f"[{completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    server_args = ServerArgs.from_cli_args(args)  # a bad setting fails before torch loads
    from octavo.server.launch import launch_server

    return launch_server(server_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="Octavo GPT-2 inference")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(handler=_serve)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    # The load-test client (octavo.bench) loads only when this runs; its own parser reads
    # the flags (`octavo bench serve --help` lists them, with or without the `bench` extra).
    bench_serve = bench_commands.add_parser(
        "serve", add_help=False,
        help="load-test an OpenAI-compatible server (flags as vllm bench serve)",
    )  # fmt: skip
    bench_serve.set_defaults(handler=_bench_serve, takes_extra_args=True)

    generate = commands.add_parser("generate", help="complete prompts offline and print them")
    add_flags(generate.add_argument_group("engine"), EngineConfig)
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
    from octavo.bench import load_test

    bench_args = load_test.build_parser().parse_args(args.extra_args)
    try:
        return load_test.run(bench_args)
    except ModuleNotFoundError as exc:
        if exc.name not in load_test.BENCH_EXTRA:
            raise
        print(
            f"octavo: error: `octavo bench serve` needs {exc.name}: pip install 'octavo[bench]'",
            file=sys.stderr,
        )
        return 2


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
