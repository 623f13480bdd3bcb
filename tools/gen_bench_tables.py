"""Writes the tables of benchmarks/README.md from benchmarks/results/*.json, so that no figure
is copied by hand and none can drift from the file it came from:

    python -m tools.gen_bench_tables            # rewrite the region between the markers
    python -m tools.gen_bench_tables --check    # exit 1 if the README's tables are stale

The region lies between BEGIN and END. Its tables are grouped by machine (the file name's
suffix: _cpu, _nvidia_h100_80gb_hbm3, ...), then by the JSON's "benchmark"; each kind has
one small table of the figures its files carry, its first header cell naming the kind and
the file (commit, date, CPU model: whichever the file records). A file of a kind with no
table here is listed by name, so a new result shows up, and --check fails, until it has
one. tests/docs/test_bench_tables.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
BEGIN = "<!-- tables:begin (python -m tools.gen_bench_tables writes this region) -->"
END = "<!-- tables:end -->"
MACHINES = {
    "cpu": "CPU: the 2-core development VM",
    "nvidia_h100_80gb_hbm3": "NVIDIA H100 80GB HBM3",
    "nvidia_h200": "NVIDIA H200",
}
# A file can hold the runs of several trees; these are the runs of the tree that is current
# (the others are the commits it was measured against).
CURRENT_RUNS = {
    "profile_decode_gpt2_norm_linear_removed_nvidia_h100_80gb_hbm3.json": [
        "call2.now_round1",
        "call2.now_round2",
    ],
}

Result = tuple[str, dict[str, Any]]


# -- formatting -----------------------------------------------------------------------------


def num(value: float | None, digits: int | None = None) -> str:
    """A figure as the tables show it: thousands separated, one decimal below 100 unless
    `digits` says otherwise, blank when absent."""
    if value is None:
        return ""
    if digits is None:
        digits = 0 if abs(value) >= 100 else 1
    return f"{value:,.{digits}f}"


def pct(fraction: float | None) -> str:
    return "" if fraction is None else f"{fraction * 100:.0f}%"


def times(ratio: float | None, digits: int = 2) -> str:
    return "" if ratio is None else f"{num(ratio, digits)}x"


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def joined(values: list[float], digits: int | None = None) -> str:
    return ", ".join(num(v, digits) for v in values)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def machine_of(name: str) -> str:
    if name.endswith("_cpu.json"):
        return "cpu"
    match = re.search(r"_(nvidia_.+)\.json$", name)
    return match.group(1) if match else "unknown"


def provenance(name: str, data: dict[str, Any]) -> str:
    """`file` (commit, date, CPU model): whichever of them the file records."""
    bits = []
    commit = data.get("commit") or (data.get("code") or {}).get("git_commit")
    if isinstance(commit, str):
        bits.append(commit.split()[0][:7])
    if isinstance(data.get("date"), str):
        bits.append(data["date"][:10])
    machine = data.get("machine")
    if isinstance(machine, dict) and machine.get("cpu_model") and machine_of(name) == "cpu":
        bits.append(" ".join(re.sub(r"\(R\)|Processor", "", machine["cpu_model"]).split()))
    return f"`{name}`" + (f" ({', '.join(bits)})" if bits else "")


def caption(title: str, result: Result) -> str:
    return f"**{title}**: {provenance(*result)}"


# -- one table per benchmark ----------------------------------------------------------------
# Each maker takes the title and the files of its kind on one machine. A table whose rows are
# files names each in its first cell; a table of one file names it in its first header cell.


def cpu_peers(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        workloads = result[1]["workloads"]
        # A served system ("octavo serve (default)") shares its engine's column.
        columns: list[str] = []
        for work in workloads.values():
            for system in work["systems"]:
                column = system["system"].replace(" serve", "")
                columns += [] if column in columns else [column]
        rows = []
        for key, work in workloads.items():
            by_column = {s["system"].replace(" serve", ""): s for s in work["systems"]}
            cells = [by_column.get(c, {}) for c in columns]
            if "concurrency" in work:
                rates = [c.get("output_token_throughput") for c in cells]
                rows.append(
                    [f"{key}: {plural(work['concurrency'], 'stream')}, tok/s"]
                    + [num(r) for r in rates]
                )
                for stat, label in (("ttft", "TTFT"), ("itl", "ITL")):
                    medians = [c[stat]["median_ms"] if stat in c else None for c in cells]
                    rows.append([f"{key}: {label} median, ms"] + [num(m) for m in medians])
            else:
                shape, width = work["shape"], work.get("beam_width")
                what = plural(work["requests"], "request") + (f", width {width}" if width else "")
                what += f", {shape['n_layer']}x{shape['n_embd']}"
                rates = [c.get("output_tokens_per_s") for c in cells]
                rows.append([f"{key}: {what}, tok/s"] + [num(r) for r in rates])
        lines += table([caption(title, result), *columns], rows)
    return lines


def quantization_quality(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        data = result[1]
        most = data["greedy"]["most"]
        rows = [
            [setting, num(r["perplexity"], 2), f"{r['greedy_agreement']} of {most}"]
            for setting, r in data["results"].items()
        ]
        lines += table(
            [caption(title, result), "perplexity", "greedy tokens as HF float32's"], rows
        )
    return lines


def speculative_decoding(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        rows = []
        methods = list(result[1]["rows"][0]["speedup"])
        for row in result[1]["rows"]:
            per_s, batch = row["output_tokens_per_s"], row["batch"]
            cells = [f"batch {batch}", num(per_s["plain"])]
            for name in methods:
                acceptance = row["acceptance"][name]
                cells += [
                    f"{num(per_s[name])} ({row['speedup'][name]:.2f}x)",
                    "no draft" if acceptance is None else f"{acceptance:.0%}",
                ]
            same = [str(row["same_tokens"][name]) for name in methods]
            cells.append(f"{' / '.join(same)} / {row['plain_first_run_same_tokens']} of {batch}")
            rows.append(cells)
        header = ["tok/s plain"]
        for name in methods:
            header += [f"{name} tok/s", "accepted"]
        header.append(f"same tokens as plain: {' / '.join(methods)} / plain's first run")
        lines += table([caption(title, result), *header], rows)
    return lines


def lora_bench(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        data = result[1]
        settings, per_s = data["settings"], data["output_tokens_per_s"]
        workload = (f"{settings['batch']} requests, {settings['num_adapters']} adapters of "
                    f"rank {settings['rank']}, {settings['dtype']}")  # fmt: skip
        cells = [workload] + [
            f"{num(value)} ({value / per_s['base']:.2f})" for value in per_s.values()
        ]
        header = [caption(title, result)] + [f"{name} tok/s (of base)" for name in per_s]
        lines += table(header, [cells])
    return lines


def first_token(title: str, files: list[Result]) -> list[str]:
    lines = []
    parts = (
        ("served", "ttft_ms"),
        ("served", "itl_ms"),
        ("engine", "ttft_ms"),
        ("engine", "itl_ms"),
    )
    for result in files:
        data = result[1]
        # A GPU session's file keeps one run per device call by name; the CPU file keeps the
        # alternated runs of each server setting.
        if isinstance(data.get("runs"), dict):
            groups = [(name, [run]) for name, run in data["runs"].items()]
        else:
            groups = [(n, runs) for n, runs in data["settings"].items() if isinstance(runs, list)]
        rows = [
            [name] + [joined([r[part][kind]["median"] for r in runs], 2) for part, kind in parts]
            for name, runs in groups
        ]
        header = ["TTFT median ms, served", "ITL median ms, served", "TTFT, engine", "ITL, engine"]
        lines += table([caption(title, result), *header], rows)
    return lines


def offline_throughput(title: str, files: list[Result]) -> list[str]:
    rows = []
    for name, data in files:
        model, systems, ratios = data["model"], data["systems"], data["ratios"]
        shape = f"{model.get('model_type', 'gpt2')} {model['n_layer']}x{model['n_embd']}"
        rates = [
            (systems.get(s) or {}).get("useful_output_tokens_per_s")
            for s in ("octavo", "hf_static", "hf_cb")
        ]
        rows.append(
            [provenance(name, data), shape, str(data["workload"]["num_requests"])]
            + [num(r) for r in rates]
            + [times(ratios.get("octavo/hf_static")), times(ratios.get("octavo/hf_cb"))]
        )
    header = ["model", "requests", "Octavo tok/s", "HF static", "HF CB", "vs static", "vs CB"]
    return table([f"**{title}**", *header], rows)


def beam_bench(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        configs = result[1]["results"]
        header = [re.sub(r"w(\d+)_p(\d+)", r"\1 x \2", key) for key in configs]
        rows = [
            ["Octavo tok/s"] + [num(r["octavo"]["output_tokens_per_s"]) for r in configs.values()],
            ["vs HF `generate`"] + [times(r["throughput_ratio"]) for r in configs.values()],
            ["HF / Octavo KV bytes copied a step"]
            + [times(r["copy_bytes_reduction"], 0) for r in configs.values()],
        ]
        lines += table([caption(title, result) + ", beams x prompt", *header], rows)
    return lines


def prefix_caching(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        on, off = result[1]["caching_on"], result[1]["caching_off"]
        rows = [
            [
                work,
                f"{num(on[work]['ttft_median_s'], 2)} / {num(off[work]['ttft_median_s'], 2)}",
                f"{num(on[work]['tokens_per_s'])} / {num(off[work]['tokens_per_s'])}",
                num(on[work]["hit_rate"], 2),
            ]
            for work in on
        ]
        header = ["TTFT median s, on / off", "tok/s, on / off", "hit rate"]
        lines += table([caption(title, result), *header], rows)
    return lines


def ray_serve(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        throughput, routing = result[1]["throughput"], result[1]["routing"]
        workloads = list(next(iter(throughput.values())))
        rows = [
            [system]
            + [
                f"{num(w['tokens_per_s'])} ({num(w['ttft_median_s'] * 1000)} ms)"
                for w in works.values()
            ]
            for system, works in throughput.items()
        ]
        # The routing policies' prefix-cache hit rates share one row: replicas, then each rate.
        policies = list(next(iter(routing.values())))
        rates = [
            f"{replicas} " + " / ".join(num(by_policy[p]["hit_rate"], 2) for p in policies)
            for replicas, by_policy in routing.items()
        ]
        rows.append([f"hit rate, {' / '.join(policies)}", ", ".join(rates), ""])
        header = [f"{w}: tok/s (TTFT median)" for w in workloads]
        lines += table([caption(title, result), *header], rows)
    return lines


def structured_outputs(title: str, files: list[Result]) -> list[str]:
    rows = []
    for name, data in files:
        libraries = [data[lib] for lib in ("llguidance", "xgrammar") if data.get(lib)]
        schema = [lib["compile"]["json_schema"]["compile_cold_ms"] for lib in libraries]
        mask = [lib["mask"]["64"]["per_row_us"] for lib in libraries]
        engine = data["engine"]
        rows.append(
            [
                provenance(name, data),
                " / ".join(num(ms, 2) for ms in schema),
                " / ".join(num(us) for us in mask),
                num(engine["none"]["tokens_per_s"]),
                f"{num(engine['half']['vs_none'], 2)} / {num(engine['all']['vs_none'], 2)}",
                num(data["ttft"]["added_ms"], 2),
            ]
        )
    header = [
        "JSON schema compile ms, cold (llguidance / xgrammar)",
        "mask at batch 64, us a row",
        "engine tok/s, none constrained",
        "half / all constrained, vs none",
        "TTFT added, cached schema, ms",
    ]
    return table([f"**{title}**", *header], rows)


def load_test_passes(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict]]:
    """(what, summary) of each pass of a load_test file, or of the load_test files a file
    holds by a setting ("by_concurrency", "by_prefill_interval")."""
    for one in data.get("passes", []):
        rate = one["request_rate"]
        yield prefix + ("all at once" if rate == "inf" else f"{num(rate, 0)} req/s"), one["summary"]
    for key, value in data.items():
        if key.startswith("by_"):
            setting = key.removeprefix("by_").replace("_", " ")
            for choice, inner in value.items():
                what = plural(int(choice), "stream") if setting == "concurrency" else ""
                what = what or f"{setting} {choice}"
                yield from load_test_passes(inner, f"{prefix}{what}, ")


def load_test(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        rows = [
            [
                what,
                f"{s['completed']} / {s['failed']}",
                num(s["output_token_throughput"]),
                f"{num(s['ttft']['median_ms'])} / {num(s['ttft']['p99_ms'])}",
                num(s["tpot"]["median_ms"], 2),
                num(s["itl"]["median_ms"], 2),
                num(s["goodput"], 2),
            ]
            for what, s in load_test_passes(result[1])
        ]
        header = ["done / failed", "output tok/s", "TTFT median / p99 ms", "TPOT median ms"]
        header += ["ITL median ms", "goodput req/s"]
        lines += table([caption(title, result), *header], rows)
    return lines


def serving_throughput(title: str, files: list[Result]) -> list[str]:
    modes: list[str] = []
    for _, data in files:
        modes += [m for m in data["served"] if m not in modes]
    rows = []
    for name, data in files:
        served = data["served"]
        cells = [
            f"{num(served[m]['tokens_per_s'])} ({pct(served[m].get('kept_of_offline'))})"
            if m in served
            else ""
            for m in modes
        ]
        rows.append(
            [provenance(name, data), str(data["workload"]["num_requests"])]
            + [num(data["offline"]["tokens_per_s"])]
            + cells
        )
    header = ["requests", "offline tok/s", *(f"served {m} (of offline)" for m in modes)]
    lines = table([f"**{title}**", *header], rows)
    for result in files:
        stacks = result[1].get("stacks_ms_per_step")
        if stacks:
            # An indented phase is part of the one above it: the table keeps the outer ones.
            phases = [p for p in next(iter(stacks.values()))["ms_per_step"] if p[0] != " "]
            rows = [[p] + [num(stacks[m]["ms_per_step"][p], 2) for m in stacks] for p in phases]
            first = caption("The engine core's ms a step by phase (py-spy)", result)
            lines += table([first, *stacks], rows)
    return lines


def api_throughput(title: str, files: list[Result]) -> list[str]:
    rows = []
    for name, data in files:
        before, after = data["before"], data["after"]
        for workload in (key for key in after if key != "commit"):
            medians = [
                num(statistics.median(run[field] for run in side[workload]))
                for field in ("api_cpu_us_per_token", "api_cpu_us_per_request")
                for side in (before, after)
            ]
            what = f"{provenance(name, data)}: {workload}, {before['commit']} / {after['commit']}"
            rows.append([what, *medians])
    header = ["API CPU us a token, before", "after", "us a request, before", "after"]
    return table([f"**{title}** (medians of the runs)", *header], rows)


def host_overhead(title: str, files: list[Result]) -> list[str]:
    batches: list[str] = []
    for _, data in files:
        for runs in data["systems"].values():
            batches += [b for b in runs if b not in batches]
    rows = []
    for name, data in files:
        for tree, runs in data["systems"].items():
            cells = [
                f"{num(runs[b]['tokens_per_s'])} ({num(runs[b]['host_us_per_token'], 1)})"
                if b in runs
                else ""
                for b in batches
            ]
            rows.append([f"{provenance(name, data)}: {tree}", *cells])
    header = [f"batch {b}: tok/s (host us a token)" for b in batches]
    return table([f"**{title}**", *header], rows)


def startup(title: str, files: list[Result]) -> list[str]:
    rows = [
        [
            f"{provenance(name, data)}: {checkout}",
            num(r["median_ready_s"], 2),
            num(r["median_first_completion_s"], 2),
        ]
        for name, data in files
        for checkout, r in data["checkouts"].items()
    ]
    return table([f"**{title}**", "s to /health (median)", "s to a first completion"], rows)


def soak(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        data = result[1]
        if "mixed" in data:
            load, rss = data["mixed"]["load"], data["mixed"]["rss"]
            rows = [
                [
                    f"{load['requests']:,} mixed requests in {num(load['wall_s'], 0)} s",
                    *(f"{num(r['before_mb'])} -> {num(r['after_mb'])}" for r in rss.values()),
                ]
            ]
            header = [f"{process} RSS MB, after warm-up -> after load" for process in rss]
        else:
            kinds = data["per_kind"]
            processes = next(iter(kinds.values()))["rss"]
            rows = [
                [f"{p} KB a request"]
                + [num(k["rss"][p]["growth_kb_per_request"], 2) for k in kinds.values()]
                for p in processes
            ]
            header = list(kinds)
        lines += table([caption(title, result), *header], rows)
    return lines


def profile_runs(name: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    runs = []
    for path in CURRENT_RUNS.get(name, [""]):
        run = data
        for key in filter(None, path.split(".")):
            run = run[key]
        runs.append(run)
    return runs


def profile_decode(title: str, files: list[Result]) -> list[str]:
    rows = []
    for name, data in files:
        runs = profile_runs(name, data)
        for i, row in enumerate(runs[0]["rows"]):
            rows.append(
                [
                    f"{provenance(name, data)}: batch {row['batch']}",
                    joined([run["rows"][i]["step_ms_median"] for run in runs], 3),
                    num(row.get("step_ms_mean"), 3),
                    num(row["gpu_busy_ms_per_step"], 3),
                    num(row["kernels_per_step"], 0),
                    pct(row["fraction_of_roofline"]),
                ]
            )
    header = ["step median ms (each run)", "step mean ms", "GPU busy ms a step", "kernels a step"]
    return table([f"**{title}**", *header, "of the bandwidth roofline"], rows)


def kernel_bench(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        data = result[1]
        cell = {(r["batch"], r["context"]): r for r in data["decode"]}
        contexts = sorted({context for _, context in cell})
        rows = [
            [f"decode, batch {b}"]
            + [
                f"{num(cell[b, c]['ours_ms'] * 1000)} ({num(cell[b, c]['sdpa_ms'] * 1000)}), "
                + pct(cell[b, c]["fraction_of_copy_bw"])
                for c in contexts
            ]
            for b in sorted({batch for batch, _ in cell})
        ]
        header = [f"context {c}: us (SDPA), of copy bandwidth" for c in contexts]
        bandwidth = f"copy {num(data['copy_bandwidth_gbps'])} GB/s"
        lines += table([f"{caption(title, result)}, {bandwidth}", *header], rows)
        prefill = data["prefill"]
        rows = [
            ["ours TFLOP/s"] + [num(r["ours_tflops"]) for r in prefill],
            ["SDPA TFLOP/s"] + [num(r["sdpa_tflops"]) for r in prefill],
            ["ours / SDPA"] + [pct(r["fraction_of_sdpa"]) for r in prefill],
        ]
        header = [f"{r['batch']} x {r['length']}" for r in prefill]
        lines += table([f"**{title}**: causal prefill", *header], rows)
    return lines


def step_latency(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        eager = {r["batch"]: r for r in result[1]["rows"] if r["mode"] == "eager"}
        rows = [
            [
                f"batch {r['batch']}",
                num(r["step_ms_median"], 3),
                num(eager.get(r["batch"], {}).get("step_ms_median"), 2),
                num(r["hf_ms_per_token"], 2),
                times(r["speedup_vs_hf"], 1),
            ]
            for r in result[1]["rows"]
            if r["mode"] == "cuda_graphs"
        ]
        header = ["CUDA graphs step ms", "eager", "HF `generate` ms a token", "graphs vs HF"]
        lines += table([caption(title, result), *header], rows)
    return lines


def cpu_contention(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        rows = result[1]["rows"]
        header = [f"{r['busy_processes']} busy beside it" for r in rows]
        cells = [
            ["median ms"] + [num(r["median_ms"], 2) for r in rows],
            ["ratio to none"] + [num(r["ratio_to_first"], 2) for r in rows],
        ]
        lines += table([caption(title, result), *header], cells)
    return lines


def fairness(title: str, files: list[Result]) -> list[str]:
    lines = []
    for result in files:
        rows = []
        for name, run in result[1]["runs"].items():
            chat = run.get("chat")
            clients = [c for c in ("chat", "flood", "heavy", "light") if c in run]
            shares = " / ".join(f"{c} {pct(run[c].get('share_of_served_tokens'))}" for c in clients)
            rows.append([
                {"alone": "interactive alone", "backlogged-fcfs": "two backlogged, fcfs",
                 "backlogged-fair": "two backlogged, fair"}.get(name, f"beside the flood, {name}"),
                f"{num(chat['ttft_median_ms'])} / {num(chat['ttft_p90_ms'])}" if chat else "",
                times(run.get("chat_ttft_over_alone"), 1) if chat and name != "alone" else "",
                num(run.get("chat_ttft_in_mean_steps"), 2) if chat else "",
                shares if len(clients) > 1 else "",
                num(run.get("mean_step_ms")),
                num(run.get("total_generated_tokens_per_s") or chat["generated_tokens_per_s"]),
            ])  # fmt: skip
        header = ["interactive TTFT ms, median / p90", "over alone", "in mean steps",
                  "shares of tokens served", "mean step ms", "generated tok/s, all"]  # fmt: skip
        lines += table([caption(title, result), *header], rows)
    return lines


# Each benchmark's table title and maker, in the order the README shows them.
TABLES: dict[str, tuple[str, Callable[[str, list[Result]], list[str]]]] = {
    "cpu_peers": ("CPU peers", cpu_peers),
    "quantization_quality": ("Quantization quality", quantization_quality),
    "speculative_decoding": ("Speculative decoding", speculative_decoding),
    "lora_bench": ("LoRA adapters", lora_bench),
    "offline_throughput": ("Offline throughput against Hugging Face", offline_throughput),
    "serving_throughput": ("Served against offline", serving_throughput),
    "first_token": ("One stream's first token", first_token),
    "load_test": ("Serving latency", load_test),
    "serve_latency": ("Serving latency", load_test),
    "profile_decode": ("A decode step", profile_decode),
    "kernel_bench": ("Attention kernels", kernel_bench),
    "step_latency": ("Decode step latency", step_latency),
    "beam_bench": ("Beam search against Hugging Face", beam_bench),
    "prefix_caching": ("Prefix caching", prefix_caching),
    "structured_outputs": ("Structured outputs", structured_outputs),
    "api_throughput": ("The API process alone", api_throughput),
    "host_overhead": ("Host work per token", host_overhead),
    "startup": ("Startup", startup),
    "soak": ("Memory under a steady load", soak),
    "ray_serve": ("Ray Serve", ray_serve),
    "fairness": ("Clients sharing a server", fairness),
    "cpu_contention": ("CPU contention", cpu_contention),
}


def load_results() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}


def render(results: dict[str, dict[str, Any]]) -> str:
    """The region's text, its markers included."""
    lines = [BEGIN, ""]
    by_machine: dict[str, list[Result]] = {}
    for name, data in results.items():
        by_machine.setdefault(machine_of(name), []).append((name, data))
    for machine in [*MACHINES, *sorted(set(by_machine) - set(MACHINES))]:
        files = by_machine.get(machine)
        if not files:
            continue
        lines += [f"### {MACHINES.get(machine, machine)}", ""]
        for kind, (title, make) in TABLES.items():
            mine = [result for result in files if result[1].get("benchmark") == kind]
            lines += make(title, mine) if mine else []
        others = [f"`{name}`" for name, data in files if data.get("benchmark") not in TABLES]
        lines += [f"No table yet: {', '.join(others)}.", ""] if others else []
    return "\n".join(lines + [END])


def rewritten(readme: str, region: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{README.relative_to(ROOT)} lacks the markers {BEGIN} and {END}")
    return readme[:start] + region + readme[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale tables")
    args = parser.parse_args(argv)
    current = README.read_text()
    wanted = rewritten(current, render(load_results()))
    if args.check:
        if wanted != current:
            print(f"stale: {README.relative_to(ROOT)} (run python -m tools.gen_bench_tables)")
            return 1
        return 0
    if wanted != current:
        README.write_text(wanted)
        print(f"wrote {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
