"""The garbage collector's settings for a long-running server process."""

from __future__ import annotations

import gc

# How many more tracked objects than at the last collection start a collection of the
# youngest generation in a server process (CPython's default is 700). The older generations
# keep CPython's multipliers, so each runs proportionally less often too.
SERVING_GEN0_THRESHOLD = 10_000


def tune_collector_for_serving() -> None:
    """Sets the collector up for serving: the startup heap frozen, and collections far
    rarer than CPython's default. Only for processes we own (the API and engine core
    processes, a Ray replica): `LLM` in a user's process leaves their heap alone.

    - Every object alive now (modules, the model, the app) leaves the collector's reach,
      after one full collection so that no garbage is frozen with them. A server process
      starts with a few hundred thousand tracked objects (torch alone brings most of
      them) that live as long as it does, and each full collection would walk all of
      them. vLLM freezes its server and core processes the same way.
    - A collection starts after `SERVING_GEN0_THRESHOLD` net new tracked objects instead
      of 700. Each request a server admits keeps a few hundred tracked objects alive
      (connection, tasks, parsed body, engine state) until it ends, so under the default
      every few requests set off a collection, and each one rescans the older requests'
      objects. With thousands in flight that was a large share of the API process's CPU,
      and its full collections stalled every stream at once (docs/benchmarks/history.md,
      "The collector under admission"). Cyclic garbage (uvicorn's and FastAPI's per-request
      cycles) is still collected, by the same collections, only later: an API process
      under sustained load holds more memory between its full collections, a bounded
      amount. SGLang, TensorRT-LLM and LMDeploy raise the threshold for the same reason.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, older, oldest)
