"""A server process's collector: the startup heap frozen, collections rare, cycles still
collected. Each case runs in a fresh interpreter: the settings are process-wide."""

import json
import subprocess
import sys

# Runs in the child: objects alive before the call, then a server's worth of live objects,
# then cyclic garbage (what uvicorn's and FastAPI's per-request cycles leave).
PROGRAM = """
import gc, json
from octavo.engine.heap import SERVING_GEN0_THRESHOLD, tune_collector_for_serving

startup = [[] for _ in range(1000)]
tune_collector_for_serving()
frozen = gc.get_freeze_count()
collected = []
gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["collected"]))
in_flight = [[] for _ in range(SERVING_GEN0_THRESHOLD // 2)]
collections_while_admitting = len(collected)
for _ in range(3 * SERVING_GEN0_THRESHOLD):
    cycle = []
    cycle.append(cycle)
print(json.dumps({
    "frozen": frozen,
    "collections_while_admitting": collections_while_admitting,
    "collections": len(collected),
    "cycles_collected": sum(collected),
}))
"""


def run_child() -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_server_process_collects_rarely_and_still_collects_cycles():
    from octavo.engine.heap import SERVING_GEN0_THRESHOLD

    result = run_child()
    assert result["frozen"] >= 1000  # the startup objects left the collector's reach
    # Half a threshold of live objects: CPython's default (700) would have collected several
    # times over; the server's setting not once.
    assert SERVING_GEN0_THRESHOLD // 2 > 700
    assert result["collections_while_admitting"] == 0
    # The cyclic garbage made afterwards was collected, not left to grow.
    assert result["collections"] >= 2
    assert result["cycles_collected"] >= SERVING_GEN0_THRESHOLD
