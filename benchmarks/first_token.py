"""Where one stream's first token goes: `octavo serve`'s TTFT at one stream, against its parts.

Workload: --num-requests streamed completions, one at a time (after --warmup untimed ones),
each of --prompt-len random token ids generating --output-len tokens (greedy, EOS ignored),
against one `octavo serve` of a dummy-weight GPT-2 (`serving_throughput.write_model`: the
embedded model's tokenizer, so the server detokenizes every token). A raw-socket client stamps
each received chunk with time.monotonic() (one clock for every process of the host).

The parts of the first token, means over the timed requests from the server's own /metrics
histograms (their sums and counts read before and after):
  - outside:  client TTFT - server TTFT: the client's connect and send, HTTP parsing, the
              route's validation and tokenization before the request's arrival is stamped,
              and the first event's SSE write and read back;
  - queue:    arrival -> first scheduled: the hop to the core, its wake-up, admission;
  - step:     server TTFT - queue: the steps until the first token is on the host, the hop
              back to the API process and detokenization.
Then, with the server stopped, the engine alone in this process (`LLMEngine`, the same model
and flags): a request's first token from `add_request` to the `step()` that returns it, and
its inter-token latency at batch 1: the floor that the served figures are read against.

    .venv/bin/python -m benchmarks.first_token --layers 2 --hidden 64 --heads 2
    python3 -m benchmarks.first_token --device cuda --dtype float16 --preset gpt2

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import serving_throughput
from benchmarks.provenance import REPO_ROOT, header, machine, write_result
from benchmarks.sse_client import free_port, running_server
from octavo.engine.config import DTYPES
from octavo.server.server_args import ServerArgs

MODEL_NAME = serving_throughput.MODEL_NAME
# The server's histograms whose means make the parts (name -> part).
HISTOGRAMS = {
    "octavo:time_to_first_token_seconds": "server_ttft",
    "octavo:request_queue_time_seconds": "queue",
}
# serving_throughput's presets' shapes (their workloads are that script's).
PRESETS = {
    name: {key: preset[key] for key in ("layers", "hidden", "heads")}
    for name, preset in serving_throughput.PRESETS.items()
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="extra `octavo serve` flags, also the in-process engine's where "
                        "they are engine flags (last on the line)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    return parser.parse_args(argv)


def prompts(args: argparse.Namespace, vocab: int, count: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab - 1) for _ in range(args.prompt_len)] for _ in range(count)]


# -- served ------------------------------------------------------------------------------


def stream_once(port: int, prompt: list[int], max_tokens: int) -> list[float]:
    """One streamed completion; time.monotonic() at the send and at each received chunk that
    holds an event, one stamp per event (events read together share one)."""
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True, "stream": True}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stamps = [time.monotonic()]
        sock.sendall(head + body)
        received = b""
        while chunk := sock.recv(1 << 16):
            now = time.monotonic()
            received += chunk
            stamps += [now] * chunk.count(b"data: {")
    # An error event is `data: {"error": ...}`; a token's text may well be "error".
    if b"data: [DONE]" not in received or b'data: {"error"' in received:
        raise RuntimeError(f"the stream failed: {received[-500:]!r}")
    return stamps


def histogram_sums(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of HISTOGRAMS, from the server's /metrics."""
    sums: dict[str, list[float]] = {part: [0.0, 0.0] for part in HISTOGRAMS.values()}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            name, _, value = line.partition(" ")
            for metric, part in HISTOGRAMS.items():
                if name == f"{metric}_sum":
                    sums[part][0] = float(value)
                elif name == f"{metric}_count":
                    sums[part][1] = float(value)
    return {part: (total, count) for part, (total, count) in sums.items()}


def run_served(model: Path, args: argparse.Namespace, vocab: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "octavo", "serve", "--model", str(model), "--served-model-name",
           MODEL_NAME, "--port", str(port), "--log-level", "warning", "--load-format", "dummy",
           "--device", args.device, "--dtype", args.dtype, *args.server_args]  # fmt: skip
    requests = prompts(args, vocab, args.warmup + args.num_requests)
    with running_server(cmd, port, cwd=REPO_ROOT):
        for prompt in requests[: args.warmup]:
            stream_once(port, prompt, args.output_len)
        before = histogram_sums(port)
        streams = [stream_once(port, p, args.output_len) for p in requests[args.warmup :]]
        after = histogram_sums(port)
    ttft = [stamps[1] - stamps[0] for stamps in streams]
    itl = [b - a for stamps in streams for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    means = {
        part: (after[part][0] - before[part][0]) / max(after[part][1] - before[part][1], 1)
        for part in HISTOGRAMS.values()
    }
    mean_ttft = statistics.fmean(ttft)
    return {
        "command": " ".join(cmd[1:]),
        "ttft_ms": summary(ttft),
        "itl_ms": summary(itl),
        "events_per_request": statistics.fmean(len(s) - 1 for s in streams),
        "parts_mean_ms": {
            "outside": (mean_ttft - means["server_ttft"]) * 1e3,
            "queue": means["queue"] * 1e3,
            "step": (means["server_ttft"] - means["queue"]) * 1e3,
            "client_ttft": mean_ttft * 1e3,
        },
    }


# -- the engine alone --------------------------------------------------------------------


def run_engine(model: Path, args: argparse.Namespace, vocab: int) -> dict:
    """The same requests through an in-process `LLMEngine`, one at a time."""
    from octavo.engine import SamplingParams
    from octavo.engine.frontend.llm_engine import LLMEngine

    # The engine config `octavo serve` would build from the same flags.
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = ["--model", str(model), "--load-format", "dummy", "--device", args.device,
             "--dtype", args.dtype, *args.server_args]  # fmt: skip
    engine = LLMEngine(ServerArgs.from_cli_args(parser.parse_args(flags)).engine)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttft, itl = [], []
    for i, prompt in enumerate(prompts(args, vocab, args.warmup + args.num_requests)):
        stamps = [time.monotonic()]
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            if any(o.outputs and o.outputs[0].token_ids for o in engine.step()):
                stamps.append(time.monotonic())
        if i >= args.warmup:
            ttft.append(stamps[1] - stamps[0])
            itl += [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return {"ttft_ms": summary(ttft), "itl_ms": summary(itl)}


def summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {
        "median": statistics.median(ordered) * 1e3,
        "mean": statistics.fmean(ordered) * 1e3,
        "p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "count": len(ordered),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        workload = argparse.Namespace(
            prompt_len=(args.prompt_len, args.prompt_len),
            output_len=(args.output_len, args.output_len),
            layers=args.layers, hidden=args.hidden, heads=args.heads,
        )  # fmt: skip
        vocab = serving_throughput.write_model(model, workload)
        served = run_served(model, args, vocab)
        engine = run_engine(model, args, vocab)
    result = {
        **header("first_token", machine(args.device)),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "served": served,
        "engine": engine,
    }
    write_result(args.result_file, result)
    parts = served["parts_mean_ms"]
    print(
        f"served: TTFT median {served['ttft_ms']['median']:.2f} ms (mean {parts['client_ttft']:.2f}"
        f" = outside {parts['outside']:.2f} + queue {parts['queue']:.2f} + step "
        f"{parts['step']:.2f}), ITL median {served['itl_ms']['median']:.3f} ms"
    )
    print(
        f"engine alone: TTFT median {engine['ttft_ms']['median']:.2f} ms, ITL median "
        f"{engine['itl_ms']['median']:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
