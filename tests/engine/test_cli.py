"""`octavo generate` end to end, as a subprocess, against the offline API's output."""

import subprocess
import sys

from octavo.engine import LLM, SamplingParams


def octavo_generate(model_dir: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "octavo",
        "generate",
        "--model",
        model_dir,
        "--device",
        "cpu",
        "--num-blocks",
        "64",
        *flags,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_octavo_generate_prints_the_greedy_completion(tiny_model_dir):
    result = octavo_generate(tiny_model_dir, "--max-tokens", "12", "--ignore-eos", "The class")
    assert result.returncode == 0, result.stderr
    llm = LLM(model=tiny_model_dir, device="cpu", num_blocks=64)
    expected = llm.generate(
        "The class", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert result.stdout.splitlines() == [
        f"The class{expected.outputs[0].text}",
        "[length, 12 tokens]",
    ]


def test_octavo_generate_reports_bad_input_without_a_traceback(tiny_model_dir):
    result = octavo_generate(tiny_model_dir, "--max-tokens", "0", "hi")
    assert result.returncode == 2
    assert "max_tokens" in result.stderr and "Traceback" not in result.stderr
