"""What the server answers a fixed mix of requests, as JSON: the proof that a change to the
serving code left the responses as they were.

    python -m tools.stream_snapshot --out FILE [--stream-interval N]

The app of `octavo serve` runs in this process on the embedded default model (its engine core
in a thread, requests through httpx's ASGITransport: no socket). 160 requests go to it one at
a time, a mix drawn from a fixed seed: /v1/completions and /v1/chat/completions, streamed or
not, greedy or seeded sampling, n of 1 to 3, logprobs, prompt logprobs, stop strings, echo,
several prompts, usage chunks. The file holds every response's status and parsed body (each
event of a stream, [DONE] included), less what differs from run to run (ids, `created`),
and the SHA-256 of each body's bytes with those normalized too, so that a change in the bytes
a parser would not see (key order, spacing, framing) is a change of the file.

A stream's events depend on how far its reader lags the engine (a reader that falls behind
gets the steps it missed in one event), so the core here steps only once the event loop has
nothing left to do: every output of a step has become its events before the next step runs,
and two runs of the same code write the same file. Run it from another checkout (its root as
the working directory) to snapshot that checkout's code: it prints which octavo it imported.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import octavo
from octavo.engine import EngineConfig
from octavo.engine.core.engine_core import EngineCore
from octavo.engine.core_messages import EngineCoreOutputs
from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.engine.frontend.core_client import InprocessCoreClient
from octavo.engine.frontend.tokenizer import load_tokenizer
from octavo.server.app import create_app
from octavo.server.chat_template import load_chat_template
from octavo.server.server_args import DEFAULT_MODEL
from octavo.server.serving_engine import ServerConfig

NUM_REQUESTS = 160
SEED = 20261127
MODEL_NAME = "octavo-tiny-chat"
BASE_URL = "http://snapshot.test"
# ChatML without tools, the snapshot's own: its chat streams stay those of this template,
# whatever template the checkpoint carries.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPTS = [
    "The list",
    "def main():",
    "Lists are",
    "A dictionary maps",
    "import os\nimport sys\n",
    "Return the number of",
    "class Stack:\n    ",
    "The for statement",
    "Raises ValueError if",
    "x",
]
# Short texts the default model (trained on Python's reference text) writes often.
STOP_STRINGS = [".", " the", "\n", ",", "e ", "()", " is", ":"]
CHAT_MESSAGES = [
    [{"role": "user", "content": "Name a list."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a dict?"}],
    [
        {"role": "user", "content": "Write a loop."},
        {"role": "assistant", "content": "for x in y:"},
        {"role": "user", "content": "And a function?"},
    ],
]
# The core steps once this many loop turns in a row found nothing else ready, at least.
SETTLE_TURNS = 3


class LockstepCoreClient(InprocessCoreClient):
    """The core in a thread, as `AsyncEngine.in_process` has it, except that after sending a
    step's outputs the core waits until the event loop is idle: every stream has taken its
    output and written its events, so no reader ever lags and a stream's events do not
    depend on timing."""

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_death: Callable[[BaseException], None],
    ) -> None:
        busy_loop = self.core.run_busy_loop

        def lockstep(receive, send) -> None:  # the parent's loop, its sends waiting
            def send_and_settle(outputs: EngineCoreOutputs) -> None:
                send(outputs)  # queues on_outputs on the loop; settle runs after it
                idle = threading.Event()

                def settle(turns: int) -> None:
                    # asyncio's ready queue: the callbacks of this loop turn not yet run, and
                    # those scheduled for the next. Empty, nothing runs until the core sends.
                    ready = loop._ready  # type: ignore[attr-defined]
                    if turns < SETTLE_TURNS or ready:
                        loop.call_soon(settle, turns + 1 if not ready else 0)
                    else:
                        idle.set()

                loop.call_soon_threadsafe(settle, 0)
                idle.wait()

            busy_loop(receive, send_and_settle)

        self.core.run_busy_loop = lockstep  # type: ignore[method-assign]
        super().start(loop, on_outputs, on_death)


def requests(count: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """`count` (route, body) pairs drawn from `seed`: the same list on every run."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        chat = rng.random() < 0.45
        body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": rng.choice([1, 2, 5, 9, 16, 32])}
        body["stream"] = rng.random() < 0.7
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body |= {"temperature": rng.choice([0.7, 1.0, 1.3]), "seed": rng.randrange(1 << 16)}
            if rng.random() < 0.3:
                body["top_k"] = rng.choice([5, 40])
        body["n"] = rng.choice([1, 1, 2, 3])
        if body["temperature"] == 0 and body["n"] > 1:
            body["seed"] = rng.randrange(1 << 16)  # greedy samples: all the same text
        if rng.random() < 0.35:
            stop = rng.sample(STOP_STRINGS, rng.choice([1, 2]))
            body["stop"] = stop[0] if len(stop) == 1 else stop
            body["include_stop_str_in_output"] = rng.random() < 0.3
        if rng.random() < 0.15:
            body["ignore_eos"] = True
        if rng.random() < 0.15:
            body["prompt_logprobs"] = rng.choice([0, 2])
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {
                "include_usage": rng.random() < 0.8,
                "continuous_usage_stats": rng.random() < 0.4,
            }
        if chat:
            body["messages"] = rng.choice(CHAT_MESSAGES)
            if rng.random() < 0.4:
                body["logprobs"] = True
                if rng.random() < 0.7:
                    body["top_logprobs"] = rng.choice([0, 1, 3])
            drawn.append(("/v1/chat/completions", body))
            continue
        prompts = rng.sample(PROMPTS, rng.choice([1, 1, 1, 2]))
        body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
        if rng.random() < 0.4:
            body["logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.25:
            body["echo"] = True
            if rng.random() < 0.3:
                body["max_tokens"] = 0  # the prompt scored, nothing generated
                if "prompt_logprobs" in body and "logprobs" in body:
                    body["prompt_logprobs"] = body["logprobs"]
        drawn.append(("/v1/completions", body))
    return drawn


# What differs between two runs of the same code: ids and creation times.
_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def normalized(body: bytes) -> bytes:
    return _VOLATILE.sub(rb'"\1":"-"', body)


def stable(data: Any) -> Any:
    """A response's JSON without its id and creation time."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in ("id", "created")}
    return data


def parsed(response: httpx.Response, streamed: bool) -> dict[str, Any]:
    body = response.content
    result: dict[str, Any] = {
        "status": response.status_code,
        "sha256": hashlib.sha256(normalized(body)).hexdigest(),
    }
    if not (streamed and response.status_code == 200):
        result["body"] = stable(response.json())
        return result
    text = body.decode()
    assert text.endswith("\n\n"), "a stream ends with a whole event"
    events = []
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event, event
        data = event.removeprefix("data: ")
        events.append(data if data == "[DONE]" else stable(json.loads(data)))
    result["events"] = events
    return result


async def snapshot(stream_interval: int) -> dict[str, Any]:
    model = str(DEFAULT_MODEL)
    config = EngineConfig(
        model=model, device="cpu", dtype="float32", num_blocks=1024, block_size=8,
        max_num_seqs=64, max_num_batched_tokens=512, stream_interval=stream_interval,
    )  # fmt: skip
    engine = AsyncEngine(
        LockstepCoreClient(EngineCore(config)),
        load_tokenizer(model, config.load_format),
        max_num_waiting=1024,
        stream_interval=stream_interval,
    )
    server_config = ServerConfig(
        served_model_name=MODEL_NAME,
        model_root=model,
        shutdown_grace_seconds=1.0,
        chat_template=load_chat_template(CHAT_TEMPLATE, model, "auto"),
    )
    app = create_app(engine, server_config)
    # ASGITransport runs no lifespan: send its startup and shutdown (the engine's start and
    # drain) as uvicorn would.
    inbox: asyncio.Queue[dict] = asyncio.Queue()
    outbox: asyncio.Queue[dict] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    lifespan = asyncio.create_task(app(scope, inbox.get, outbox.put))  # type: ignore[arg-type]
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    results = []
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=60) as http:
            for route, body in requests(NUM_REQUESTS, SEED):
                response = await http.post(route, json=body)
                results.append({"route": route, "request": body} | parsed(response, body["stream"]))
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        await lifespan
    return {"stream_interval": stream_interval, "num_requests": len(results), "responses": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--stream-interval", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"octavo from {Path(octavo.__file__).parent}", file=sys.stderr)
    result = asyncio.run(snapshot(args.stream_interval))
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    statuses: dict[int, int] = {}
    for response in result["responses"]:
        statuses[response["status"]] = statuses.get(response["status"], 0) + 1
    print(f"{result['num_requests']} responses {statuses} -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
