"""A server process's collector: the startup heap frozen, collections rare, cycles still
collected. Each case runs in a fresh interpreter: the settings are process-wide."""

import json
import subprocess
import sys

# Runs in the child: a server's worth of live objects made under CPython's default, then
# the same after `tune_collector_for_serving`, then cyclic garbage (what uvicorn's and
# FastAPI's per-request cycles leave).
PROGRAM = """
import gc, json
from octavo.engine.heap import SERVING_GEN0_THRESHOLD, tune_collector_for_serving

collected = []
gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["collected"]))
startup = [[] for _ in range(SERVING_GEN0_THRESHOLD // 2)]
collections_by_default = len(collected)
tune_collector_for_serving()
frozen = gc.get_freeze_count()
before = len(collected)
in_flight = [[] for _ in range(SERVING_GEN0_THRESHOLD // 2)]
collections_while_admitting = len(collected) - before
before = len(collected)
for _ in range(3 * SERVING_GEN0_THRESHOLD):
    cycle = []
    cycle.append(cycle)
print(json.dumps({
    "frozen": frozen,
    "collections_by_default": collections_by_default,
    "collections_while_admitting": collections_while_admitting,
    "collections_of_garbage": len(collected) - before,
    "cycles_collected": sum(collected[before:]),
}))
"""


def run_child() -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_server_process_collects_rarely_and_still_collects_cycles():
    from octavo.engine.heap import SERVING_GEN0_THRESHOLD

    result = run_child()
    # The objects alive at the call (the startup lists among them) left the collector.
    assert result["frozen"] >= SERVING_GEN0_THRESHOLD // 2
    # The same live objects set off collections under CPython's default, none after.
    assert result["collections_by_default"] > 0
    assert result["collections_while_admitting"] == 0
    # The cyclic garbage made afterwards was collected, not left to grow.
    assert result["collections_of_garbage"] >= 2
    assert result["cycles_collected"] >= SERVING_GEN0_THRESHOLD
