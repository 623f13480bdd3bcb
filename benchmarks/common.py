"""What the offline benchmarks share: the dummy model, the HF peer, the machine's description."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

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
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_result_file(benchmark: str, device: str, preset: str | None) -> Path:
    """results/<benchmark>_cpu.json on CPU (the development machine's model shape);
    results/<benchmark>_<preset>_<gpu name>.json on CUDA."""
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return RESULTS_DIR / f"{benchmark}_cpu.json"
    gpu = torch.cuda.get_device_name(torch.device(device)).lower().replace(" ", "_")
    return RESULTS_DIR / f"{benchmark}_{preset or 'custom'}_{gpu}.json"


def write_checkpoint(folder: Path, args: argparse.Namespace) -> GPT2Config:
    """Writes a dummy-weight GPT-2 (args: vocab, n_positions, hidden, layers, heads, seed) as a
    Hugging Face folder, so every system runs the very same weights (lm_head tied)."""
    eos = args.vocab - 1  # never stops anything: every system ignores EOS
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.n_positions,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(args.seed)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return config


def add_model_arguments(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """The dummy model's shape (--preset or --layers/--hidden/--heads, --vocab,
    --n-positions) and --result-file; finish with resolve_model_arguments."""
    parser.add_argument(
        "--preset", choices=sorted(GPT2_PRESETS), help="a GPT-2 size: sets layers, hidden, heads"
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512, help="n_embd")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--n-positions", type=int, default=1024)
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


def load_hf_model(folder: Path, device: str, dtype: torch.dtype) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # EOS must never end a sequence
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model.to(device).eval()


def machine_info(device: str) -> dict:
    """CPU model (from lscpu), cores, threads, versions, and the GPU's name on CUDA."""
    model_name = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    info = {
        "cpu_model": model_name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def git_commit(root: Path) -> str | None:
    """The short commit of the checkout at `root`, or None outside git."""
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
