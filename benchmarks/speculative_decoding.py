"""What speculative decoding gains, and costs where it should switch itself off.

Workload: prompts that quote a passage and ask for it again (a passage of pydoc's topics, the
text the embedded model was trained on, then "Again:" and its first words), greedy, EOS
ignored, --max-tokens each. `LLM.generate` on --batch-sizes requests at a time without
speculation ("plain"), with method ngram (prompt lookup --prompt-lookup-min..
--prompt-lookup-max) and, unless --draft-layers is 0, with a draft model: the embedded
model's first --draft-layers layers (the smaller model of the same vocabulary this machine
has; a trained one, distilgpt2 for gpt2, agrees more). Both speculate
--num-speculative-tokens tokens up to --disable-by-batch-size running sequences. The engines
alternate, --repeats timed runs each after an untimed one of the same requests (medians and
every run kept).

Reported per batch size and engine: output tok/s and the ratio to plain; the draft tokens
verified and accepted (acceptance = accepted / drafted; tokens a step = output tokens /
model steps); and how many requests' tokens equal plain's (in bfloat16, prefix hits and
batch shapes can flip a near-tie: plain's own uncached first run is compared too).

    .venv/bin/python -m benchmarks.speculative_decoding
    .venv/bin/python -m benchmarks.speculative_decoding --smoke --result-file /tmp/s.json

--smoke: fewer, shorter requests, to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from benchmarks import common, provenance
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
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", help="cuda: batch 1's tok/s is 1 / ITL")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a quick check of the script")
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.result_file is None:
        args.result_file = common.default_result_file(
            "speculative_decoding", args.device, "embedded"
        )
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


def first_layers(source: Path, layers: int, folder: Path) -> Path:
    """A copy of the GPT-2 checkpoint at `source` keeping its first `layers` layers (and its
    embeddings, final norm and tokenizer), written to `folder`."""
    kept = set(range(layers))
    weights = {
        name: tensor
        for name, tensor in load_file(source / "model.safetensors").items()
        if not name.startswith("transformer.h.") or int(name.split(".")[2]) in kept
    }
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"n_layer": layers}))
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


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
    shared = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    configs: dict[str, dict | None] = {
        "plain": None,
        "ngram": shared | {
            "method": "ngram",
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        },
    }  # fmt: skip
    scratch = tempfile.TemporaryDirectory()
    if args.draft_layers:
        draft = first_layers(DEFAULT_MODEL, args.draft_layers, Path(scratch.name))
        configs["draft_model"] = shared | {"model": str(draft)}
    engines = {
        name: LLM(
            str(DEFAULT_MODEL),
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            speculative_config=config,
        )  # fmt: skip
        for name, config in configs.items()
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = quoting_prompts(batch, args.seed + batch)
        walls: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list] = {}
        counters: dict[str, dict] = {}
        # Untimed: the first run of a batch size builds the kernels of its row counts.
        first = {
            name: llm.generate(prompts, params, use_tqdm=False) for name, llm in engines.items()
        }
        for _ in range(args.repeats):
            for name, llm in engines.items():  # alternating: the machine drifts
                wall, tokens[name], counters[name] = timed(llm, prompts, params)
                walls[name].append(wall)
        output_tokens = batch * args.max_tokens
        per_s = {name: output_tokens / statistics.median(w) for name, w in walls.items()}
        row = {
            "batch": batch,
            "output_tokens": output_tokens,
            "wall_s_runs": walls,
            "output_tokens_per_s": per_s,
            "speedup": {name: per_s[name] / per_s["plain"] for name in engines if name != "plain"},
            "draft_tokens": {name: c["num_draft_tokens"] for name, c in counters.items()},
            "accepted_tokens": {name: c["num_accepted_tokens"] for name, c in counters.items()},
            "acceptance": {
                name: c["num_accepted_tokens"] / c["num_draft_tokens"]
                if c["num_draft_tokens"] else None
                for name, c in counters.items() if name != "plain"
            },
            "tokens_per_step": {
                name: c["num_generation_tokens"] / c["num_steps"] for name, c in counters.items()
            },
            "same_tokens": {
                name: sum(a == b for a, b in zip(tokens["plain"], t, strict=True))
                for name, t in tokens.items() if name != "plain"
            },
            # Plain's uncached first run against its last: what prefix hits and other batch
            # shapes move in a low-precision dtype, where a near-tie can flip.
            "plain_first_run_same_tokens": sum(
                a == b.outputs[0].token_ids
                for a, b in zip(tokens["plain"], first["plain"], strict=True)
            ),
        }  # fmt: skip
        rows.append(row)
        print(
            f"batch {batch:3d}: plain {per_s['plain']:8,.1f} tok/s; "
            + "; ".join(
                f"{name} {per_s[name]:8,.1f} ({row['speedup'][name]:.2f}x, acceptance "
                f"{row['acceptance'][name]}, same tokens {row['same_tokens'][name]}/{batch})"
                for name in row["speedup"]
            ),
            flush=True,
        )
    scratch.cleanup()
    result = {
        **common.result_header("speculative_decoding", args.device),
        "model": DEFAULT_MODEL.name,
        "settings": {
            "speculative_config": {k: v for k, v in configs.items() if v is not None},
            "draft_layers": args.draft_layers,
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
