"""Profile of one steady decode step: how much of a step the GPU is busy, and where the host
time goes, at several batch sizes (CUDA graphs on unless --enforce-eager).

--arrivals N profiles a server's steady state under arrivals instead: before every step
the N oldest requests end (aborted, outside the step's timing) and N new ones of
--arrival-prompt-len tokens arrive, so each step prefills N prompts beside batch - N
decodes. Such mixed steps do not fit the decode graphs; this measures what they cost.

For each batch size, `batch` requests of --prompt-len random tokens are prefilled, then
--warmup-steps decode steps run untimed. Three passes of --steps decode steps each follow:
  1. wall: perf_counter around every `engine.step()` (no profiler attached): the step time.
  2. gpu: torch.profiler with CPU and CUDA activities; the union of the device's kernel and
     memcpy intervals inside the profiled steps over their wall time = GPU busy fraction
     (on CUDA only). The profiler slows the host, so this pass's wall time is reported
     apart and the busy fraction is a lower bound when the host is the limit.
  3. host: cProfile of the same steps: cumulative time of the engine's own phases
     (schedule, execute and its parts, update, outputs) per step.
Whether the host path or the kernels limit throughput is read off pass 1 vs the GPU-busy
time of pass 2: a step much longer than its GPU time is host-bound. The bandwidth roofline
of a step is the bytes it must read (every weight, every running sequence's K/V) over the
measured device-to-device copy bandwidth.

    python -m benchmarks.profile_decode --device cuda --dtype float16 --preset gpt2
    python -m benchmarks.profile_decode --smoke --result-file /tmp/p.json

--smoke: a 2-layer model on the CPU, a few steps, to check the script; its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks import common, provenance
from benchmarks.copy_bandwidth import device_copy_bandwidth
from octavo.engine import LLMEngine, RequestOutputKind, SamplingParams

SMOKE_BATCHES, SMOKE_STEPS, SMOKE_WARMUP = (1, 2), 3, 1
COPY_BYTES = 1 << 30
STEP_ANNOTATION = "octavo_step"
# How the CUDA profiler names device events that are copies or fills, not kernels.
DEVICE_COPY_PREFIXES = ("Memcpy", "Memset")
SETTINGS = ("preset", "dtype", "batches", "prompt_len", "steps", "warmup_steps", "enforce_eager",
            "seed", "smoke", "arrivals", "arrival_prompt_len", "prefill_interval",
            "piecewise_cuda_graphs")  # fmt: skip
# The engine's phases whose cumulative time pass 3 reports: (label, file suffix, function).
PHASES = (
    ("schedule", "scheduler.py", "schedule"),
    ("execute.host_inputs", "input_batch.py", "prepare"),
    ("execute.graph_replay", "cuda_graphs.py", "run"),
    # Steps the decode graphs do not take (named forward_eager before piecewise graphs).
    ("execute.forward", "model_runner.py", "_forward"),
    ("execute.forward_piecewise", "piecewise_graphs.py", "forward"),  # part of the above
    ("execute.sample", "sampler.py", "__call__"),
    ("execute.triton_launches", "jit.py", "run"),  # Triton's Python launch path (not on CPU)
    ("update", "scheduler.py", "update"),
    ("outputs", "output_processor.py", "process"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_preset_arguments(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps per pass")
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--arrivals",
        type=int,
        default=0,
        help="requests ending and arriving before every step (0: decode-only steps)",
    )
    p.add_argument("--arrival-prompt-len", type=int, default=24)
    p.add_argument(
        "--prefill-interval",
        type=int,
        default=None,
        help="the engine's: arrivals admitted at most every this many steps (default: the "
        "engine's)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="schedule one step ahead or not (default: the engine's, on for CUDA)",
    )
    p.add_argument(
        "--piecewise-cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="steps that prefill replay piecewise graphs or not (default: the engine's, on "
        "with CUDA graphs)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="also write each batch's profiled steps as a gzipped Chrome trace",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.dtype, args.device = "smoke", "float32", "cpu"
        args.batches, args.steps, args.warmup_steps = SMOKE_BATCHES, SMOKE_STEPS, SMOKE_WARMUP
        args.prompt_len = 8
        args.arrivals = min(args.arrivals, min(args.batches))
    if not 0 <= args.arrivals <= min(args.batches):
        p.error(f"--arrivals must be between 0 and the smallest batch, got {args.arrivals}")
    return common.resolve_preset_arguments(args, "profile_decode")


class Workload:
    """The requests of one batch size, oldest first; `churn()` before each timed step makes
    the --arrivals (the oldest requests aborted, as many new ones added)."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace, batch: int):
        self.engine, self.args, self.batch = engine, args, batch
        # As many tokens as the context allows, so no request ends mid-profile however many
        # steps the batch takes to fill (with a --prefill-interval, prompts are admitted only
        # every few steps). Outputs only when a request ends, as `LLM.generate` asks for them.
        self.params = SamplingParams(
            temperature=0,
            max_tokens=engine.max_model_len - max(args.prompt_len, args.arrival_prompt_len),
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self.ids: list[str] = []  # oldest first
        self.num_added = 0
        self._add(batch, args.prompt_len)

    def _add(self, count: int, prompt_len: int) -> None:
        seed = self.args.seed + self.batch + self.num_added
        for prompt in common.random_prompts(count, prompt_len, self.args.vocab, seed):
            request_id = f"p{self.batch}-{self.num_added}"
            self.engine.add_request(request_id, prompt, self.params)
            self.ids.append(request_id)
            self.num_added += 1

    def start(self) -> None:
        """Steps until every request is past its prefill, then the warm-up steps."""
        running, prompt_len = self.engine.scheduler.running, self.args.prompt_len
        while sum(g.seqs[0].num_computed_tokens >= prompt_len for g in running) < self.batch:
            if self.engine.step():  # FINAL_ONLY: an output means a request ended
                raise RuntimeError(f"a request of the batch of {self.batch} ended before the "
                                   "batch was all prefilled")  # fmt: skip
        for _ in range(self.args.warmup_steps):
            self.churn()
            self.engine.step()

    def churn(self) -> None:
        """With --arrivals N: the N oldest requests end and N new ones arrive."""
        arrivals = self.args.arrivals
        for request_id in self.ids[:arrivals]:
            self.engine.abort_request(request_id)
        del self.ids[:arrivals]
        self._add(arrivals, self.args.arrival_prompt_len)

    def finish(self) -> None:
        for request_id in self.ids:
            self.engine.abort_request(request_id)  # frees its blocks at once


def bytes_per_step(engine: LLMEngine) -> int:
    """The least a decode step must read: every weight once (the LM head is the tied
    embedding) and the K and V of every running sequence's context, all layers."""
    model = engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    kv_per_token = config.n_layer * 2 * config.n_embd * engine.runner.kv_cache.element_size()
    tokens = sum(seq.num_computed_tokens for g in engine.scheduler.running for seq in g.seqs)
    return weights + kv_per_token * tokens


def wall_pass(workload: Workload, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        workload.churn()
        start = time.perf_counter()
        workload.engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def gpu_pass(workload: Workload, steps: int, cuda: bool, trace: Path | None) -> dict:
    """The profiled window runs from the first step's start to the last one's end: with
    --arrivals it holds the churn between steps too, time the GPU may idle."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            workload.churn()
            with torch.profiler.record_function(STEP_ANNOTATION):
                workload.engine.step()
    if trace is not None:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            trace.write_bytes(gzip.compress(raw.read_bytes()))
    events = prof.events()
    step_ranges = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name == STEP_ANNOTATION and e.device_type == DeviceType.CPU
    ]
    window_start, window_end = step_ranges[0][0], step_ranges[-1][1]
    window_us = window_end - window_start
    # The step's own annotation also has a device-side span (first to last kernel of the
    # step): it is not work, and counting it would hide the gaps between kernels.
    device_events = [
        e for e in events if e.device_type == DeviceType.CUDA and e.name != STEP_ANNOTATION
    ]
    busy = [
        (max(e.time_range.start, window_start), min(e.time_range.end, window_end))
        for e in device_events
        if e.time_range.end > window_start and e.time_range.start < window_end
    ]
    # Kernels (not copies or memsets) that start within the profiled steps.
    kernels = [
        e for e in device_events
        if window_start <= e.time_range.start < window_end
        and not e.name.startswith(DEVICE_COPY_PREFIXES)
    ]  # fmt: skip
    top_kernels = sorted(
        (
            {"name": k.key[:120], "count": k.count, "device_us": k.self_device_time_total}
            for k in prof.key_averages()
            if k.self_device_time_total > 0 and k.key != STEP_ANNOTATION
        ),
        key=lambda k: -k["device_us"],
    )[:12]
    top_host_ops = sorted(
        (
            {"name": k.key[:120], "count": k.count, "self_cpu_us": k.self_cpu_time_total}
            for k in prof.key_averages()
            if k.key != STEP_ANNOTATION
        ),
        key=lambda k: -k["self_cpu_us"],
    )[:12]
    return {
        "profiled_step_ms": window_us / 1e3 / steps,
        "gpu_busy_ms_per_step": union_us(busy) / 1e3 / steps if cuda else None,
        "gpu_busy_fraction": union_us(busy) / window_us if cuda else None,
        "kernels_per_step": len(kernels) / steps if cuda else None,
        "top_kernels": top_kernels,
        "top_host_ops": top_host_ops,
    }


def host_pass(workload: Workload, steps: int) -> dict[str, float]:
    """Milliseconds per step spent in each engine phase (cumulative, as cProfile sees it)."""
    profiler = cProfile.Profile()
    total_ms = 0.0
    for _ in range(steps):
        workload.churn()
        start = time.perf_counter()
        profiler.enable()
        workload.engine.step()
        profiler.disable()
        total_ms += (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(profiler).stats
    phases = {"step_total_under_cprofile": total_ms / steps}
    for label, suffix, function in PHASES:
        cumulative = sum(
            entry[3] for (path, _, name), entry in stats.items()
            if path.endswith(suffix) and name == function
        )  # fmt: skip
        phases[label] = cumulative * 1e3 / steps
    return phases


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    rows = []
    with common.dummy_checkpoint(args) as folder:
        engine = common.make_engine(
            folder, args, max_num_seqs=max(args.batches), enforce_eager=args.enforce_eager,
            max_num_batched_tokens=max(2048, max(args.batches)),
            async_scheduling=args.async_scheduling, prefill_interval=args.prefill_interval,
            piecewise_cuda_graphs=args.piecewise_cuda_graphs,
        )  # fmt: skip
        bandwidth = device_copy_bandwidth(args.device, COPY_BYTES) if cuda else None
        for batch in args.batches:
            workload = Workload(engine, args, batch)
            workload.start()
            prompt_tokens = engine.scheduler.num_prompt_tokens
            generated = engine.scheduler.updater.num_generation_tokens
            wall = wall_pass(workload, args.steps // 2)
            step_bytes = bytes_per_step(engine)  # the middle of the wall pass
            wall += wall_pass(workload, args.steps - args.steps // 2)
            prompt_tokens = engine.scheduler.num_prompt_tokens - prompt_tokens
            generated = engine.scheduler.updater.num_generation_tokens - generated
            trace = None
            if args.trace_dir is not None:
                args.trace_dir.mkdir(parents=True, exist_ok=True)
                trace = args.trace_dir / f"profile_decode_b{batch}.json.gz"
            gpu = gpu_pass(workload, args.steps, cuda, trace)
            host = host_pass(workload, args.steps)
            workload.finish()
            median = statistics.median(wall)
            roofline_ms = step_bytes / bandwidth * 1e3 if bandwidth else None
            row = {
                "batch": batch,
                "step_ms_median": median,
                # With --arrivals and a --prefill-interval, the mixed steps are the few slow
                # ones: the mean, not the median, is what throughput follows.
                "step_ms_mean": statistics.fmean(wall),
                # Tokens sampled over the timed steps' own time: under arrivals admitted every
                # few steps the batch is not always `batch` sequences.
                "generated_tokens_per_s": generated / (sum(wall) / 1e3),
                "output_tokens_per_s": batch / (median / 1e3),
                "prompt_tokens_per_step": prompt_tokens / len(wall),
                "bytes_per_step": step_bytes,
                "roofline_step_ms": roofline_ms,
                "fraction_of_roofline": roofline_ms / median if roofline_ms else None,
                **gpu,
                "host_phases_ms_per_step": host,
            }
            rows.append(row)
            busy = row["gpu_busy_ms_per_step"]
            busy_text = (
                "n/a"
                if busy is None
                else (f"{busy:.3f} ms/step ({row['gpu_busy_fraction']:.0%} of the profiled steps)")
            )
            roof_text = (
                "n/a"
                if roofline_ms is None
                else (f"{roofline_ms:.3f} ms ({roofline_ms / median:.0%} of the step)")
            )
            print(
                f"batch {batch:4d}: step {median:.3f} ms (mean {row['step_ms_mean']:.3f}, "
                f"{row['generated_tokens_per_s']:,.0f} tok/s), "
                f"GPU busy {busy_text}, "
                f"bandwidth roofline {roof_text}, kernels per step {row['kernels_per_step']}"
            )
            print("   host phases (ms/step, cProfile): " + ", ".join(
                f"{k} {v:.3f}" for k, v in host.items()
            ))  # fmt: skip
    result = {
        **common.result_header("profile_decode", args.device),
        "settings": {
            **{key: getattr(args, key) for key in SETTINGS},
            "async_scheduling": engine.config.uses_async_scheduling,
            "prefill_interval": engine.config.effective_prefill_interval,
        },
        "copy_bandwidth_gbps": bandwidth / 1e9 if bandwidth else None,
        "rows": rows,
    }
    provenance.write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
