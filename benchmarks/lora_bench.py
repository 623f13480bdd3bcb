"""What serving LoRA adapters costs: the base model alone against requests of several adapters
mixed in one batch.

Workload: --batch requests of --prompt-len random tokens, greedy, EOS ignored, --max-tokens
each, through `LLM.generate` on a dummy GPT-2 (--preset or --layers/--hidden/--heads). Three
runs of the same requests, alternating, --repeats timed rounds after an untimed one:
- base: an engine without LoRA;
- lora_engine_base_requests: an engine with enable_lora (max_loras --num-adapters), every
  request on the base (what the adapter slots cost when unused);
- mixed: that engine, request i under adapter i % --num-adapters (random factors of rank
  --rank on all four products of every layer, PEFT's format, written to a temporary folder).

Reported: output tok/s of each (median) and each over base's.

    .venv/bin/python -m benchmarks.lora_bench --dtype bfloat16 --repeats 5
    .venv/bin/python -m benchmarks.lora_bench --smoke --result-file /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks import common, provenance
from octavo.engine import LLM, LoRARequest, SamplingParams
from octavo.engine.lora_adapter import TARGETS, target_shape
from octavo.engine.worker.models.model_files import load_model_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser, "lora_bench")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a quick check of the script")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.vocab = 2, 64, 2, 512
        args.batch, args.max_tokens, args.num_adapters, args.rank, args.repeats = 6, 4, 3, 4, 1
    return common.resolve_model_arguments(args, "lora_bench")


def write_adapter(folder: Path, model_dir: Path, rank: int, seed: int) -> None:
    """A rank-`rank` adapter of every target product of every layer, random factors."""
    config = load_model_config(str(model_dir), "auto")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.n_layer):
        for target in TARGETS:
            in_features, out_features = target_shape(config, target)
            key = f"base_model.model.transformer.h.{layer}.{target}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
            weights[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    folder.mkdir(parents=True)
    save_file(weights, folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
                "target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(1, args.vocab, (args.prompt_len,), generator=generator).tolist()
        for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with common.dummy_checkpoint(args) as model_dir, tempfile.TemporaryDirectory() as scratch:
        adapters = []
        for i in range(args.num_adapters):
            folder = Path(scratch) / f"adapter{i}"
            write_adapter(folder, model_dir, args.rank, seed=args.seed + i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
        shared = {"model": str(model_dir), "device": args.device, "dtype": args.dtype,
                  "seed": args.seed}  # fmt: skip
        base = LLM(**shared)
        lora = LLM(**shared, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
        mixed = [adapters[i % len(adapters)] for i in range(args.batch)]
        runs = {
            "base": lambda: base.generate(prompts, params, use_tqdm=False),
            "lora_engine_base_requests": lambda: lora.generate(prompts, params, use_tqdm=False),
            "mixed": lambda: lora.generate(prompts, params, use_tqdm=False, lora_request=mixed),
        }
        for run in runs.values():  # untimed: kernels and adapters loaded
            run()
        walls: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():  # alternating: the machine drifts
                start = time.perf_counter()
                outputs = run()
                walls[name].append(time.perf_counter() - start)
                assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
    output_tokens = args.batch * args.max_tokens
    per_s = {name: output_tokens / statistics.median(w) for name, w in walls.items()}
    ratios = {name: per_s[name] / per_s["base"] for name in runs if name != "base"}
    for name in runs:
        print(f"{name:28s} {per_s[name]:10,.1f} tok/s ({per_s[name] / per_s['base']:.2f} of base)")
    result = {
        **common.result_header("lora_bench", args.device),
        "model": common.model_info(args),
        "settings": {
            "dtype": args.dtype,
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "num_adapters": args.num_adapters,
            "rank": args.rank,
            "targets": list(TARGETS),
            "repeats": args.repeats,
            "smoke": args.smoke,
        },  # fmt: skip
        "output_tokens": output_tokens,
        "wall_s_runs": walls,
        "output_tokens_per_s": per_s,
        "ratio_to_base": ratios,
    }
    provenance.write_result(args.result_file, result)


if __name__ == "__main__":
    main()
