"""What a precision or `--quantization` costs in quality, on the embedded model (a real, trained
GPT-2, trained on pydoc's topics), each Octavo setting against Hugging Face's float32 and
bfloat16 on the same weights:

- greedy agreement: of each prompt's MAX_TOKENS greedy tokens, how many match HF float32's
  before the first difference (summed over the prompts);
- perplexity of a text the model was not trained on (the docstrings of some of Python's
  standard library modules, not in pydoc's topics), in windows of the model's context:
  exp(mean negative log-likelihood) of every token after each window's first, from Octavo's
  prompt_logprobs and from HF's logits.

    python -m benchmarks.quantization_quality
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
from pathlib import Path

import tokenizers
import torch
from transformers import AutoModelForCausalLM

from benchmarks import common, provenance
from octavo.engine import LLM, SamplingParams
from octavo.server.server_args import DEFAULT_MODEL

MAX_TOKENS = 32
# Standard library modules whose docstrings make the held-out text.
MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib", "re",
           "shutil", "string", "textwrap", "datetime", "heapq", "bisect", "csv")  # fmt: skip
PROMPT_TOKENS = 8
NUM_PROMPTS = 24
# Octavo's settings, by name: LLM keyword arguments.
SETTINGS = {
    "octavo float32": {"dtype": "float32"},
    "octavo bfloat16": {"dtype": "bfloat16"},
    "octavo int8 (bfloat16)": {"dtype": "bfloat16", "quantization": "int8"},
    "octavo int8 (float32)": {"dtype": "float32", "quantization": "int8"},
}


def held_out_text() -> str:
    """The docstrings of MODULES' public functions and classes, in a fixed order."""
    docs = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = inspect.getdoc(getattr(module, attr))
            if not attr.startswith("_") and doc and len(doc) > 80:
                docs.append(doc)
    return "\n\n".join(dict.fromkeys(docs))  # each once, first place kept


def windows(ids: list[int], width: int) -> list[list[int]]:
    """`ids` cut into consecutive windows of `width` tokens (the last shorter, but of two
    tokens at least)."""
    chunks = [ids[i : i + width] for i in range(0, len(ids), width)]
    return [chunk for chunk in chunks if len(chunk) > 1]


def greedy_prompts(ids: list[int]) -> list[list[int]]:
    """NUM_PROMPTS prompts of PROMPT_TOKENS tokens each, evenly spaced through `ids`."""
    step = len(ids) // NUM_PROMPTS
    return [ids[i * step : i * step + PROMPT_TOKENS] for i in range(NUM_PROMPTS)]


def hf_nll(model, chunks: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood of every token after each chunk's first, and its count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in chunks:
            logits = model(torch.tensor([chunk])).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(chunk[1:])
            total -= logprobs.gather(1, target[:, None]).sum().item()
            count += len(chunk) - 1
    return total, count


def octavo_nll(llm: LLM, chunks: list[list[int]]) -> tuple[float, int]:
    """hf_nll's sums, from Octavo's prompt_logprobs."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for chunk, output in zip(chunks, llm.generate(chunks, params), strict=True):
        assert output.prompt_logprobs is not None
        for token, entry in zip(chunk[1:], output.prompt_logprobs[1:], strict=True):
            assert entry is not None
            total -= entry[token]
            count += 1
    return total, count


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens in common with the reference, from the start of each continuation."""
    total = 0
    for got, want in zip(tokens, reference, strict=True):
        pairs = enumerate(zip(got, want, strict=False))
        total += next((i for i, (a, b) in pairs if a != b), len(want))
    return total


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """HF's MAX_TOKENS greedy tokens after `prompt`, EOS or not."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def quality_row(nll: float, count: int, greedy: list[list[int]], reference: list[list[int]]):
    return {"perplexity": math.exp(nll / count), "greedy_agreement": agreement(greedy, reference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result-file", type=Path,
                        default=common.RESULTS_DIR / "quantization_quality_cpu.json")  # fmt: skip
    args = parser.parse_args()
    tokenizer = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    ids = tokenizer.encode(held_out_text()).ids
    hf32 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    chunks = windows(ids, hf32.config.n_positions)
    prompts = greedy_prompts(ids)
    reference = [hf_greedy(hf32, p) for p in prompts]
    rows = {}
    for name, dtype in (("hf float32", torch.float32), ("hf bfloat16", torch.bfloat16)):
        model = hf32 if dtype == torch.float32 else AutoModelForCausalLM.from_pretrained(
            DEFAULT_MODEL, dtype=dtype).eval()  # fmt: skip
        nll, count = hf_nll(model, chunks)
        rows[name] = quality_row(nll, count, [hf_greedy(model, p) for p in prompts], reference)
        print(name, rows[name], flush=True)
    for name, settings in SETTINGS.items():
        llm = LLM(str(DEFAULT_MODEL), device="cpu", kv_cache_gb=0.25, **settings)
        nll, count = octavo_nll(llm, chunks)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True))  # fmt: skip
        greedy = [o.outputs[0].token_ids for o in outputs]
        rows[name] = quality_row(nll, count, greedy, reference)
        print(name, rows[name], flush=True)
        del llm
    result = {
        **common.result_header("quantization_quality", "cpu"),
        "model": str(DEFAULT_MODEL.name),
        "text": {"modules": MODULES, "tokens": len(ids), "windows": len(chunks)},
        "greedy": {
            "prompts": NUM_PROMPTS,
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": MAX_TOKENS,
            "most": NUM_PROMPTS * MAX_TOKENS,
        },  # fmt: skip
        "results": rows,
    }
    provenance.write_result(args.result_file, result)


if __name__ == "__main__":
    main()
