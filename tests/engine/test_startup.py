"""What an engine start costs on CPU: building the engine and generating import none of torch's
compiler stack (torch._dynamo, sympy), which would add seconds to every `octavo serve` start
and every engine core process."""

import subprocess
import sys

# Modules only torch's compiler and its Python reference ops load.
COMPILER_STACK = ("torch._dynamo", "sympy")

PROGRAM = """
import sys
from octavo.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", num_blocks=64)
(output,) = llm.generate(["The while statement"], SamplingParams(max_tokens=4, ignore_eos=True))
assert len(output.outputs[0].token_ids) == 4
print(sorted(name for name in sys.argv[2:] if name in sys.modules))
"""


def test_an_engine_starts_and_generates_without_torchs_compiler_stack(tiny_model_dir):
    # A fresh interpreter: this test process has imported transformers and more.
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, tiny_model_dir, *COMPILER_STACK],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", run.stdout
