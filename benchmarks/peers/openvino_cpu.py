"""One workload on OpenVINO GenAI, run by cpu_peers.py with the python of OpenVINO's own venv
(openvino, openvino-genai, openvino-tokenizers, optimum-intel): this file imports nothing of
Octavo's.

    python openvino_cpu.py SPEC.json RESULT.json

SPEC: {"model": HF folder, "ir_dir": where its export is kept (made when missing, so that
rounds export once), "weights": "default" | "int8", "precision": null | "f32",
"pipeline": "llm" | "continuous_batching", "prompts": [[ids]], "max_tokens": [n per
prompt], "repeats": R, "beam_width": W (0: greedy)}. The folder is exported to OpenVINO IR
by optimum-intel, as its users do (`OVModelForCausalLM.from_pretrained(export=True)`):
"default" keeps the checkpoint's weights (optimum-intel quantizes by default only models
over a billion parameters), "int8" asks for int8 weights (8-bit weight compression); its
tokenizer by openvino-tokenizers. `precision` "f32" sets the CPU plugin's inference precision
(its default on a CPU with bfloat16 units is bfloat16). "llm" runs the prompts through
`LLMPipeline` one at a time (a batch of one: its single-user API), "continuous_batching"
all at once through `ContinuousBatchingPipeline`. Greedy (or beam search, in-engine), EOS
ignored. RESULT and warm-up as vllm_cpu.py's.
"""

import json
import sys
import time
from pathlib import Path

from timing import time_runs, write_result  # this folder's, beside the script


def export(folder: str, weights: str, out: str) -> None:
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
    from transformers import AutoTokenizer

    if weights == "int8":
        model = OVModelForCausalLM.from_pretrained(
            folder, export=True, quantization_config=OVWeightQuantizationConfig(bits=8)
        )
    else:
        model = OVModelForCausalLM.from_pretrained(folder, export=True, load_in_8bit=False)
    model.save_pretrained(out)
    tokenizer, detokenizer = convert_tokenizer(
        AutoTokenizer.from_pretrained(folder), with_detokenizer=True
    )
    ov.save_model(tokenizer, str(Path(out) / "openvino_tokenizer.xml"))
    ov.save_model(detokenizer, str(Path(out) / "openvino_detokenizer.xml"))


def generation_config(max_tokens: int, beam_width: int):
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.min_new_tokens = max_tokens
    config.ignore_eos = True
    if beam_width:
        config.num_beams = beam_width
        config.num_beam_groups = 1
        config.num_return_sequences = 1
    return config


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import numpy as np
    import openvino as ov
    import openvino_genai

    properties = {"INFERENCE_PRECISION_HINT": spec["precision"]} if spec["precision"] else {}
    out = spec["ir_dir"]
    start = time.perf_counter()
    if not (Path(out) / "openvino_model.xml").exists():
        export(spec["model"], spec["weights"], out)
    if spec["pipeline"] == "llm":
        pipeline = openvino_genai.LLMPipeline(out, "CPU", **properties)
    else:
        pipeline = openvino_genai.ContinuousBatchingPipeline(
            out, openvino_genai.SchedulerConfig(), "CPU", properties
        )
    load_s = time.perf_counter() - start

    def tensor(prompt):
        return ov.Tensor(np.array([prompt], dtype=np.int64))

    def run(prompts, max_tokens):
        configs = [generation_config(n, spec["beam_width"]) for n in max_tokens]
        if spec["pipeline"] == "llm":
            outputs = []
            for prompt, config in zip(prompts, configs, strict=True):
                result = pipeline.generate(tensor(prompt), config)
                outputs.append(list(result.tokens[0]))
            return outputs
        results = pipeline.generate([tensor(p) for p in prompts], configs)
        return [list(r.m_generation_ids[0]) for r in results]

    runs, outputs = time_runs(run, spec["prompts"], spec["max_tokens"], spec["repeats"])
    write_result(sys.argv[2], openvino_genai.__version__, load_s, runs, outputs)


if __name__ == "__main__":
    main()
