"""What the benchmarks share: the dummy model and its flags, the workloads' random prompts,
the engines, the HF peer, timing, and the result header with torch's versions (provenance.py
has the torch-free rest: the machine, the commit, writing the JSON)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    PreTrainedModel,
)

from benchmarks.provenance import header, machine
from octavo.engine import LLM, EngineConfig, LLMEngine
from octavo.engine.config import DTYPES

# HF wants a pad id; padded positions are masked out (or there is no padding at all).
PAD_TOKEN_ID = 0
# (n_layer, n_embd, n_head) of the released GPT-2 sizes.
GPT2_PRESETS = {
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
# The released GPT-2's vocabulary and context, and the 2-layer model of the smoke runs.
GPT2_VOCAB, GPT2_N_POSITIONS = 50257, 1024
SMOKE_PRESET = (2, 64, 2)
# The GPU-first scripts (--preset) also take the smoke model by name.
PRESETS_WITH_SMOKE = {**GPT2_PRESETS, "smoke": SMOKE_PRESET}
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The dummy model's architecture by config.json's model_type: GPT-2, or GPTBigCode with
# multi-query attention (one K/V head) in the same shape.
ARCHITECTURES = {
    "gpt2": (GPT2Config, GPT2LMHeadModel, {}),
    "gpt_bigcode": (GPTBigCodeConfig, GPTBigCodeForCausalLM, {"multi_query": True}),
}
T = TypeVar("T")


def default_result_file(benchmark: str, device: str, preset: str | None) -> Path:
    """results/<benchmark>_cpu.json on CPU (the development machine's model shape);
    results/<benchmark>_<preset>_<gpu name>.json on CUDA."""
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return RESULTS_DIR / f"{benchmark}_cpu.json"
    gpu = torch.cuda.get_device_name(torch.device(device)).lower().replace(" ", "_")
    return RESULTS_DIR / f"{benchmark}_{preset or 'custom'}_{gpu}.json"


# -- timing ---------------------------------------------------------------------------------


class PhaseTimer:
    """Accumulates the wall time of wrapped calls per label (on CUDA the device is synced
    around each call, so its work counts); clear `totals` between measurements."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.totals[label] += time.perf_counter() - start

        return timed

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# -- the dummy model ------------------------------------------------------------------------


def write_checkpoint(folder: Path, args: argparse.Namespace) -> None:
    """Writes a dummy-weight model (args: model_type, vocab, n_positions, hidden, layers, heads,
    seed) as a Hugging Face folder, so every system runs the very same weights (lm_head
    tied)."""
    config_class, model_class, flags = ARCHITECTURES[args.model_type]
    eos = args.vocab - 1  # never stops anything: every system ignores EOS
    config = config_class(
        vocab_size=args.vocab,
        n_positions=args.n_positions,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=eos,
        eos_token_id=eos,
        **flags,
    )
    torch.manual_seed(args.seed)
    model_class(config).save_pretrained(folder)


@contextlib.contextmanager
def dummy_checkpoint(args: argparse.Namespace) -> Iterator[Path]:
    """The dummy model of `args` in a temporary folder that lives as long as the block."""
    with tempfile.TemporaryDirectory(prefix="octavo_bench_") as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, args)
        yield folder


def model_info(args: argparse.Namespace) -> dict:
    """The dummy model's shape and weights, as every result file names them."""
    model_class = ARCHITECTURES[args.model_type][1]
    return {
        "model_type": args.model_type,
        "n_layer": args.layers,
        "n_embd": args.hidden,
        "n_head": args.heads,
        "vocab_size": args.vocab,
        "n_positions": args.n_positions,
        "weights": f"dummy ({model_class.__name__} init, torch seed {args.seed})",
    }


def add_model_type_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-type",
        default="gpt2",
        choices=sorted(ARCHITECTURES),
        help="the dummy model's architecture (gpt_bigcode: multi-query attention)",
    )


def add_model_arguments(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """The CPU-first scripts' device and dtype, the dummy model's shape (--preset or
    --layers/--hidden/--heads, --vocab, --n-positions), --seed and --result-file; finish with
    resolve_model_arguments."""
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    add_model_type_argument(parser)
    parser.add_argument(
        "--preset", choices=sorted(GPT2_PRESETS), help="a GPT-2 size: sets layers, hidden, heads"
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512, help="n_embd")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--n-positions", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the workload")
    parser.add_argument(
        "--result-file",
        type=Path,
        help=f"default: results/{benchmark}_cpu.json on CPU, "
        f"results/{benchmark}_<preset>_<gpu>.json on CUDA",
    )


def resolve_model_arguments(args: argparse.Namespace, benchmark: str) -> argparse.Namespace:
    """Applies --preset and picks the default result file for the device."""
    if args.preset:
        args.layers, args.hidden, args.heads = GPT2_PRESETS[args.preset]
    if args.result_file is None:
        args.result_file = default_result_file(benchmark, args.device, args.preset)
    return args


def add_preset_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPU-first scripts' device, dtype and model (a released GPT-2 size, or the smoke
    model), seed and --result-file; finish with resolve_preset_arguments."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--preset", default="gpt2", choices=sorted(PRESETS_WITH_SMOKE))
    add_model_type_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)


def resolve_preset_arguments(args: argparse.Namespace, benchmark: str) -> argparse.Namespace:
    """The preset's shape, GPT-2's vocabulary and context, and the default result file."""
    args.layers, args.hidden, args.heads = PRESETS_WITH_SMOKE[args.preset]
    args.vocab, args.n_positions = GPT2_VOCAB, GPT2_N_POSITIONS
    if args.result_file is None:
        args.result_file = default_result_file(benchmark, args.device, args.preset)
    return args


def add_engine_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """Octavo's batch cap, step token budget and KV cache size (HF CB's too, where it runs),
    and how many timed runs."""
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the batch cap")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="the per-step token budget"
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=2.0,
        help="Octavo's KV cache size",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=repeats,
        help="timed runs per system; the median is reported (all are kept)",
    )


# -- workloads and engines ------------------------------------------------------------------


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `prompt_len` random ids from torch's generator seeded by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=generator).tolist()


def make_llm(folder: Path, args: argparse.Namespace, **overrides) -> LLM:
    """The offline API over the dummy model with the flags of add_engine_arguments."""
    settings = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gb": args.kv_cache_gb,
        **overrides,
    }
    return LLM(model=str(folder), dtype=args.dtype, device=args.device, seed=args.seed, **settings)


def make_engine(folder: Path, args: argparse.Namespace, **settings) -> LLMEngine:
    """An engine over the dummy model, driven step by step."""
    config = EngineConfig(
        model=str(folder), device=args.device, dtype=args.dtype, seed=args.seed, **settings
    )
    return LLMEngine(config)


def load_hf_model(folder: Path, device: str, dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # EOS must never end a sequence
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model.to(device).eval()


# -- timing and comparing -------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], T], device: str) -> tuple[float, T]:
    """Wall seconds of one call of fn, the device's queued work included, and what it
    returned."""
    synchronize(device)
    start = time.perf_counter()
    value = fn()
    synchronize(device)
    return time.perf_counter() - start, value


@dataclass
class SystemResult:
    """One system's timing on a workload; `outputs` holds its generated ids per request (kept
    out of the result file)."""

    name: str
    wall_s: float | None = None  # median over the timed repeats
    wall_s_runs: list[float] = field(default_factory=list)
    error: str | None = None
    notes: str = ""
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        data = asdict(self)
        del data["outputs"]
        return data


R = TypeVar("R", bound=SystemResult)


def guarded(log_prefix: str, name: str, fn: Callable[[], R], result_type: type[R]) -> R:
    """Runs one system; an exception becomes an error entry instead of ending the benchmark
    (a peer that cannot run is a result, not a crash)."""
    print(f"{log_prefix}: running {name} ...", flush=True)
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return result_type(name, error=f"{type(exc).__name__}: {exc}")


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a
    prefix of the other), or None if they are equal."""
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return diff if diff is not None or len(a) == len(b) else min(len(a), len(b))


def safe_div(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is unknown or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- results --------------------------------------------------------------------------------


def machine_info(device: str) -> dict:
    """provenance's `machine(device)` with torch's threads and versions."""
    return {
        **machine(device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
    }


def result_header(benchmark: str, device: str) -> dict:
    """The first keys of every offline benchmark's result: what ran, when, where, on which
    commit."""
    return header(benchmark, machine_info(device))
