"""/metrics against what a request did: the engine's counters move by what it computed, the
latency histograms by what the client got."""

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME

DASHBOARD = Path(__file__).parents[3] / "deploy" / "grafana" / "octavo.json"

MAX_TOKENS = 7


def test_a_lone_request_of_n_tokens_counts_n_engine_steps(app_server, client):
    """Alone on the engine (CPU: no step scheduled ahead), a greedy request's prompt takes
    one step, which samples its first token, and each further token one more: engine_steps,
    from which a benchmark reads tokens per step (the batch's fill), counts exactly those."""
    before = app_server.metrics()
    client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = app_server.metrics()
    for counter in ("octavo:engine_steps_total", "octavo:generation_tokens_total"):
        assert after[counter] - before[counter] == MAX_TOKENS, counter


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_streams_inter_token_latencies_are_its_events_after_the_first(app_server, client, route):
    """One latency per event of a choice after its first (n=1: an output is one event)."""
    name = "octavo:inter_token_latency_seconds"
    before = app_server.metrics()
    if route == "completions":
        stream = client.completions.create(
            model=MODEL_NAME, prompt="Hello there", max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        events = [chunk for chunk in stream if chunk.choices]
    else:
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        events = [
            chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.role is None
        ]
    after = app_server.metrics()
    assert len(events) > 1
    assert after[f"{name}_count"] - before[f"{name}_count"] == len(events) - 1
    assert after[f"{name}_sum"] > before[f"{name}_sum"]


def test_the_grafana_dashboard_queries_only_what_the_server_exposes(app_server, client):
    """Every octavo:* series a panel of deploy/grafana/octavo.json queries is a family or a
    sample of /metrics (a labelled family with no sample yet, as LoRA's on a server without
    adapters, still shows its TYPE line); every panel has a query and a unique id."""
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)  # fill histograms
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"octavo:[A-Za-z0-9_:]+", target["expr"]))
    exposed = set()
    for family in text_string_to_metric_families(app_server.http.get("/metrics").text):
        exposed.add(family.name)
        exposed |= {sample.name for sample in family.samples}
        if family.type == "counter":
            exposed.add(family.name + "_total")
    assert queried and queried <= exposed, sorted(queried - exposed)
    # What users look for first: requests, TTFT and ITL, KV cache, preemptions, speculative
    # decoding's acceptance, LoRA.
    for name in ("octavo:time_to_first_token_seconds_bucket", "octavo:kv_cache_usage_perc",
                 "octavo:inter_token_latency_seconds_bucket", "octavo:num_preemptions_total",
                 "octavo:spec_decode_num_accepted_tokens_total", "octavo:lora_requests_running",
                 "octavo:num_requests_waiting"):  # fmt: skip
        assert name in queried, name
