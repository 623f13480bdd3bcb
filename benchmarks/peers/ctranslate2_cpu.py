"""One workload on CTranslate2, run by cpu_peers.py with the python of CTranslate2's own venv
(ctranslate2, transformers, torch): this file imports nothing of Octavo's.

    python ctranslate2_cpu.py SPEC.json RESULT.json

SPEC: {"model": HF folder, "compute_type": "int8" | "float32", "prompts": [[ids]],
"max_tokens": [n per prompt], "repeats": R, "threads": T}. The model is converted with
CTranslate2's own converter, weights quantized to the compute type. CTranslate2 takes token
strings: the folder's tokenizer names id i "t<i>" (cpu_peers.py writes it), so ids map one to
one. Greedy, EOS never ends a sequence; all prompts in one batch, as CTranslate2 batches.
RESULT and warm-up as vllm_cpu.py's.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

from timing import time_runs, write_result  # this folder's, beside the script


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    with tempfile.TemporaryDirectory(prefix="ct2_") as out:
        start = time.perf_counter()
        TransformersConverter(spec["model"]).convert(
            out, quantization=spec["compute_type"], force=True
        )
        generator = ctranslate2.Generator(
            out, device="cpu", compute_type=spec["compute_type"], intra_threads=spec["threads"]
        )
        load_s = time.perf_counter() - start
        prompts = [[f"t{i}" for i in p] for p in spec["prompts"]]

        def run(prompts, max_tokens):
            longest = max(max_tokens)
            results = generator.generate_batch(
                prompts,
                max_length=longest,
                min_length=longest,
                sampling_topk=1,
                include_prompt_in_result=False,
                end_token=[],
            )
            return [
                [int(t[1:]) for t in r.sequences[0]][:n]
                for r, n in zip(results, max_tokens, strict=True)
            ]

        runs, outputs = time_runs(run, prompts, spec["max_tokens"], spec["repeats"])
    write_result(sys.argv[2], ctranslate2.__version__, load_s, runs, outputs)


if __name__ == "__main__":
    main()
