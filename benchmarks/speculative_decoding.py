"""What n-gram speculative decoding gains, and costs where it should switch itself off.

Workload: prompts that quote a passage and ask for it again (a passage of pydoc's topics, the
text the embedded model was trained on, then "Again:" and its first words), greedy, EOS
ignored, --max-tokens each. `LLM.generate` on --batch-sizes requests at a time, with and
without `speculative_config` (method ngram, --num-speculative-tokens, prompt lookup
--prompt-lookup-min..--prompt-lookup-max, and --disable-by-batch-size), the two engines
alternating, --repeats timed runs each after an untimed one of the same requests (medians
and every run kept).

Reported per batch size: output tok/s without and with speculation and their ratio; the
draft tokens verified and accepted (acceptance = accepted / drafted; tokens a step = output
tokens / model steps); and whether every request's tokens were the same both ways.

    .venv/bin/python benchmarks/speculative_decoding.py
    .venv/bin/python benchmarks/speculative_decoding.py --smoke --result-file /tmp/s.json

--smoke: fewer, shorter requests, to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import random
import statistics
import sys
import time
from pathlib import Path

try:
    import octavo.engine  # noqa: F401
except ImportError:  # run as a plain script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octavo.benchmarks import common, provenance
from octavo.engine import LLM, SamplingParams
from octavo.server.server_args import DEFAULT_MODEL

PASSAGE_CHARS = 300
ECHO_CHARS = 80


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--disable-by-batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a quick check of the script")
    parser.add_argument(
        "--result-file", type=Path, default=common.RESULTS_DIR / "speculative_decoding_cpu.json"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.max_tokens, args.repeats = [1, 3], 8, 1
    return args


def quoting_prompts(count: int, seed: int) -> list[str]:
    """`count` prompts: a passage of pydoc's topics, then "Again:" and its first words."""
    texts = list(pydoc_data.topics.topics.values())
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        text = texts[rng.randrange(len(texts))]
        if len(text) < PASSAGE_CHARS:
            continue
        start = rng.randrange(len(text) - PASSAGE_CHARS + 1)
        passage = text[start : start + PASSAGE_CHARS]
        prompts.append(f"{passage}\n\nAgain:\n{passage[:ECHO_CHARS]}")
    return prompts


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list, dict]:
    """Wall seconds of one generate, the outputs' tokens, and the engine's counters it moved."""
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.engine.stats()
    moved = {
        name: getattr(after, name) - getattr(before, name)
        for name in ("num_steps", "num_generation_tokens", "num_draft_tokens",
                     "num_accepted_tokens")
    }  # fmt: skip
    return wall, [o.outputs[0].token_ids for o in outputs], moved


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    engines = {
        "plain": LLM(str(DEFAULT_MODEL), dtype=args.dtype, seed=args.seed),
        "speculative": LLM(
            str(DEFAULT_MODEL), dtype=args.dtype, seed=args.seed, speculative_config=speculative
        ),
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = quoting_prompts(batch, args.seed + batch)
        walls: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list] = {}
        counters: dict[str, dict] = {}
        for llm in engines.values():
            # Untimed: the first run of a batch size builds the kernels of its row counts.
            llm.generate(prompts, params, use_tqdm=False)
        for _ in range(args.repeats):
            for name, llm in engines.items():  # alternating: the machine drifts
                wall, tokens[name], counters[name] = timed(llm, prompts, params)
                walls[name].append(wall)
        output_tokens = batch * args.max_tokens
        per_s = {name: output_tokens / statistics.median(w) for name, w in walls.items()}
        spec = counters["speculative"]
        row = {
            "batch": batch,
            "output_tokens": output_tokens,
            "wall_s_runs": walls,
            "output_tokens_per_s": per_s,
            "speedup": per_s["speculative"] / per_s["plain"],
            "draft_tokens": spec["num_draft_tokens"],
            "accepted_tokens": spec["num_accepted_tokens"],
            "acceptance": (
                spec["num_accepted_tokens"] / spec["num_draft_tokens"]
                if spec["num_draft_tokens"] else None
            ),
            "tokens_per_step": {
                name: c["num_generation_tokens"] / c["num_steps"] for name, c in counters.items()
            },
            "same_tokens": sum(
                a == b for a, b in zip(tokens["plain"], tokens["speculative"], strict=True)
            ),
        }  # fmt: skip
        rows.append(row)
        print(
            f"batch {batch:3d}: {per_s['plain']:8,.1f} -> {per_s['speculative']:8,.1f} tok/s "
            f"({row['speedup']:.2f}x), acceptance {row['acceptance']}, same tokens "
            f"{row['same_tokens']}/{batch}",
            flush=True,
        )
    result = {
        **common.result_header("speculative_decoding", "cpu"),
        "model": DEFAULT_MODEL.name,
        "settings": {
            "speculative_config": speculative,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "smoke": args.smoke,
        },  # fmt: skip
        "rows": rows,
    }
    provenance.write_result(args.result_file, result)


if __name__ == "__main__":
    main()
