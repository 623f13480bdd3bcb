"""The `octavo` command line: the only place arguments (and, later, environment) are read."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that mirror EngineConfig, shared by every subcommand that builds an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        required=True,
        help="Hugging Face-format folder or hub id (or a GPT-2 size with --load-format dummy)",
    )
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"]
    )
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-blocks", type=int, default=None)
    group.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="KV cache size on CPU when --num-blocks is not given",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    group.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        seed=args.seed,
    )


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.llm_engine import LLMEngine

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="Octavo GPT-2 inference")
    commands = parser.add_subparsers(dest="command", required=True)

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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
