"""Structured outputs: what a constraint costs, on the default model (its 4097-token
vocabulary) and this machine.

  1. compile   each kind of constraint (a JSON schema, a regex, a choice, a grammar): the
               front end's compile and validation, cold and cached, and the worker's matcher.
  2. mask      one step's masks at batch 1, 64 and 256 (`GrammarMatchers.apply_masks`: every row's
               mask filled by llguidance, then applied to random logits in one operation),
               matchers part-way through a JSON object.
  3. engine    `LLM.generate` on --num-requests prompts of 16 tokens, --output-len tokens each
               (a schema whose one string field outlasts them, so every request runs to the
               length limit): none, half and all of the batch constrained, in the same run.
  4. ttft      one request alone, from add_request to its first token, constrained by a
               cached schema or not (median of --ttft-repeats).

--xgrammar also times xgrammar on 1 and 2 (its compiler and matcher, same constraints and
tokenizer) when it can be imported; it is not a dependency of Octavo (`pip install
xgrammar`). Speed is never asserted in tests; tests/benchmarks runs --smoke.

    .venv/bin/python -m benchmarks.structured_outputs --xgrammar
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS_DIR, machine_info
from benchmarks.provenance import git_commit
from octavo.engine import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from octavo.engine.structured_outputs import _compile, compile_grammar
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.server.server_args import DEFAULT_MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,12} [0-9]{1,4}(, [a-z]+){0,3}"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [a-z]+ (" " [a-z]+)* ")"'),
}
# Where the masked matchers stand: inside a JSON string, the costliest state to mask.
JSON_PREFIX = '{"name":"Ada'
# A schema no output finishes within the budget: every request runs to the length limit
# (its one key required and no other allowed: a model free to pick keys closes the object).
LONG_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4096}},
    "required": ["text"],
    "additionalProperties": False,
}
MASK_BATCHES = (1, 64, 256)
MASK_REPEATS = 50
COMPILE_REPEATS = 20


def median_ms(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compile_times(grammars: GrammarMatchers, repeats: int) -> dict:
    """Per kind: cold compile (no cache), cached compile, and one matcher's construction."""
    rows = {}
    for name, constraint in CONSTRAINTS.items():
        grammar = compile_grammar(constraint)
        rows[name] = {
            "compile_cold_ms": median_ms(
                lambda c=constraint: _compile.__wrapped__(c.kind, c.text), repeats
            ),
            "compile_cached_ms": median_ms(lambda c=constraint: compile_grammar(c), repeats),
            "matcher_ms": median_ms(lambda g=grammar: grammars.matcher(g), repeats),
        }
    return rows


def mask_times(grammars: GrammarMatchers, vocab: int, repeats: int) -> dict:
    """Per batch size: one step's masks (fill + apply), matchers inside a JSON string."""
    grammar = compile_grammar(CONSTRAINTS["json_schema"])
    prefix = grammars.tokenizer.tokenize_str(JSON_PREFIX)
    rows = {}
    for batch in MASK_BATCHES:
        matchers = [grammars.matcher(grammar) for _ in range(batch)]
        for matcher in matchers:
            assert matcher.consume_tokens(prefix), matcher.get_error()
        logits = torch.randn(batch, vocab)
        every_row = np.arange(batch)
        step = median_ms(
            lambda x=logits, r=every_row, m=matchers: grammars.apply_masks(x, r, m), repeats
        )
        rows[str(batch)] = {"step_ms": step, "per_row_us": step * 1e3 / batch}
    return rows


def xgrammar_times(vocab: int, eos: int, repeats: int) -> dict | None:
    """The same compile and mask measurements through xgrammar, if it is installed."""
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])

    def compiled(compiler, name: str):
        constraint = CONSTRAINTS[name]
        if name == "json_schema":
            return compiler.compile_json_schema(
                json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
            )
        if name == "regex":
            return compiler.compile_regex(constraint.regex)
        if name == "choice":
            choices = " | ".join(json.dumps(c) for c in constraint.choice or [])
            return compiler.compile_grammar(f"root ::= {choices}")
        return compiler.compile_grammar(constraint.grammar)

    compile_rows = {}
    for name in CONSTRAINTS:
        cached = xgr.GrammarCompiler(info)
        grammar = compiled(cached, name)
        compile_rows[name] = {
            "compile_cold_ms": median_ms(
                lambda n=name: compiled(xgr.GrammarCompiler(info, cache_enabled=False), n),
                repeats,
            ),
            "compile_cached_ms": median_ms(lambda c=cached, n=name: compiled(c, n), repeats),
            "matcher_ms": median_ms(lambda g=grammar: xgr.GrammarMatcher(g), repeats),
        }
    grammar = compiled(xgr.GrammarCompiler(info), "json_schema")
    prefix = hf.encode(JSON_PREFIX)
    mask_rows = {}
    for batch in MASK_BATCHES:
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
        for matcher in matchers:
            for token in prefix:
                assert matcher.accept_token(token)
        logits = torch.randn(batch, vocab)
        bitmask = xgr.allocate_token_bitmask(batch, vocab)

        def step(matchers=matchers, logits=logits, bitmask=bitmask):
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
            xgr.apply_token_bitmask_inplace(logits, bitmask)

        ms = median_ms(step, repeats)
        mask_rows[str(batch)] = {"step_ms": ms, "per_row_us": ms * 1e3 / batch}
    return {"compile": compile_rows, "mask": mask_rows}


def engine_throughput(llm: LLM, args: argparse.Namespace) -> dict:
    """Output tokens/s with none, half and all of the batch constrained (same prompts)."""
    prompts = [[(17 * i + j) % 4000 + 1 for j in range(16)] for i in range(args.num_requests)]
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=args.output_len,
        structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA),
    )
    mixes = {
        "none": [plain] * len(prompts),
        "half": [constrained if i % 2 else plain for i in range(len(prompts))],
        "all": [constrained] * len(prompts),
    }
    llm.generate(prompts[:2], mixes["half"][:2], use_tqdm=False)  # tokenizer and caches
    rows: dict[str, dict] = {name: {"runs": []} for name in mixes}
    for _ in range(args.repeats):  # alternated, so drift on a shared machine hits all
        for name, params in mixes.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            if tokens != len(prompts) * args.output_len:  # the mixes would differ in work
                raise RuntimeError(f"{name}: {tokens} tokens, not every request's max_tokens")
            rows[name]["runs"].append(tokens / wall)
    for row in rows.values():
        row["tokens_per_s"] = statistics.median(row["runs"])
    for name in ("half", "all"):
        rows[name]["vs_none"] = rows[name]["tokens_per_s"] / rows["none"]["tokens_per_s"]
    return rows


def ttft(engine: LLMEngine, repeats: int) -> dict:
    """Median time from add_request to the first token of one request alone."""
    schema = StructuredOutputsParams(json=SCHEMA)

    def first_token(params: SamplingParams) -> float:
        start = time.perf_counter()
        engine.add_request("ttft", list(range(1, 17)), params)
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        elapsed = (time.perf_counter() - start) * 1e3
        engine.abort_request("ttft")
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    rows = {}
    for name, constraint in (("none", None), ("cached_schema", schema)):
        params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=constraint)
        first_token(params)  # warm: the schema's compile is cached from here on
        rows[name] = statistics.median(first_token(params) for _ in range(repeats))
    return {"none_ms": rows["none"], "cached_schema_ms": rows["cached_schema"],
            "added_ms": rows["cached_schema"] - rows["none"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="engine runs per mix")
    parser.add_argument("--ttft-repeats", type=int, default=20)
    parser.add_argument("--xgrammar", action="store_true", help="time xgrammar too")
    parser.add_argument("--smoke", action="store_true", help="a few of everything")
    parser.add_argument(
        "--result-file", type=Path, default=RESULTS_DIR / "structured_outputs_cpu.json"
    )
    args = parser.parse_args(argv)
    repeats = (2, 2) if args.smoke else (COMPILE_REPEATS, MASK_REPEATS)
    if args.smoke:
        args.num_requests, args.output_len, args.repeats, args.ttft_repeats = 4, 4, 1, 2
    llm = LLM(str(DEFAULT_MODEL))
    core = llm.engine.core
    grammars = core.runner.input_batch.grammars
    vocab, eos = core.model_config.vocab_size, core.eos_token_id
    start = time.perf_counter()
    grammars.tokenizer  # noqa: B018 -- built once, on the first constrained request
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    result = {
        "benchmark": "structured_outputs",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info("cpu"),
        "commit": git_commit(Path(__file__).resolve().parents[1]),
        "settings": {"vocab": vocab, **{k: v for k, v in vars(args).items() if k != "result_file"}},
        "llguidance": {
            "tokenizer_ms": tokenizer_ms,
            "compile": compile_times(grammars, repeats[0]),
            "mask": mask_times(grammars, vocab, repeats[1]),
        },
        "xgrammar": xgrammar_times(vocab, eos, repeats[0]) if args.xgrammar else None,
        "engine": engine_throughput(llm, args),
        "ttft": ttft(llm.engine, args.ttft_repeats),
    }
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(result, indent=2) + "\n")
    shown = ("llguidance", "xgrammar", "engine", "ttft")
    print(json.dumps({key: result[key] for key in shown}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
