"""The CPU peer benchmark runs on the smoke model without its peers' venvs: every Octavo
setting and HF report a speed, Octavo float32's tokens are HF float32's, `octavo serve`
serves the load test, and a missing peer is left out rather than fatal."""

import json

import pytest

from octavo.benchmarks import cpu_peers


@pytest.mark.slow
def test_smoke_run_reports_every_system_and_float32_matches_hf(tmp_path):
    result_file = tmp_path / "peers.json"
    cpu_peers.main(["--smoke", "--result-file", str(result_file)])
    result = json.loads(result_file.read_text())
    assert set(result["workloads"]) == set(cpu_peers.WORKLOADS)
    served = result["workloads"].pop("served")["systems"]
    assert [s["system"] for s in served] == ["octavo serve (default)"]
    assert served[0]["completed"] == cpu_peers.SMOKE_REQUESTS and served[0]["failed"] == 0
    assert served[0]["output_token_throughput"] > 0
    for name, workload in result["workloads"].items():
        systems = {s["system"]: s for s in workload["systems"]}
        assert all(s["output_tokens_per_s"] > 0 for s in systems.values())
        if workload["beam_width"]:
            assert set(systems) == {"octavo float32"}
            continue
        assert set(systems) == {*cpu_peers.OCTAVO_SETTINGS, "hf float32"}, name
        requests = workload["requests"]
        assert systems["hf float32"]["same_tokens_as_octavo_float32"] == f"{requests} of {requests}"
        assert "octavo float32" in systems["hf float32"]["ratio_to"]
