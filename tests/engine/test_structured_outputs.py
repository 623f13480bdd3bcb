"""Structured outputs in the engine: with random weights only the constraint can make an
output well-formed, so every output that ends with "stop" must validate; greedy constrained
decoding equals Hugging Face generate with a logits processor applying the same grammar;
preemption, prefix caching and one-step-ahead scheduling change no constrained token; bad
constraints are refused by name, and a grammar the request's own controls leave without a
token fails that request alone."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from llguidance import LLMatcher, LLTokenizer
from transformers import LogitsProcessor, LogitsProcessorList

from octavo.engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from octavo.engine.errors import ParameterError
from octavo.engine.structured_outputs import StructuredOutputsParams, compile_grammar
from tests.checkpoints import sample_prompts
from tests.engine.helpers import llguidance_allowed, run_to_completion
from tests.engine.test_beam_search import hf_beam_search

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
LARK = 'start: "a" ("b" | "c")+ "d"'
GBNF = 'root ::= "x" [0-9]+ "y"'


def validates(constraint: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` is a whole output the constraint allows (the oracles: jsonschema,
    re.fullmatch, membership, each grammar's equivalent regex)."""
    if constraint.json is not None or constraint.json_object:
        try:
            value = json.loads(text)
            jsonschema.validate(value, constraint.json or {"type": "object"})
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint.choice is not None:
        return text in constraint.choice
    pattern = {LARK: "a[bc]+d", GBNF: "x[0-9]+y"}.get(constraint.grammar or "", constraint.regex)
    assert pattern is not None
    return re.fullmatch(pattern, text) is not None


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "regex": StructuredOutputsParams(regex=REGEX),
    "lark": StructuredOutputsParams(grammar=LARK),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
}


def engine(model_dir: str, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", **config))


def prompts(vocab: int) -> list[list[int]]:
    return sample_prompts(3, 4, 12, vocab, seed=5)


@pytest.fixture(scope="module")
def roomy(tiny_model_dir) -> LLMEngine:
    return engine(tiny_model_dir, num_blocks=256, block_size=8)


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_output_that_stops_validates(roomy, hf_tiny, name):
    """Sampled at temperature 1 (seeded, 3 samples per prompt), every output that ends with
    "stop" is valid, and some do end; the same requests unconstrained are not valid."""
    constraint = CONSTRAINTS[name]
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=40, structured_outputs=constraint
    )
    outputs = run_to_completion(roomy, prompts(hf_tiny.config.vocab_size), params)
    samples = [c for o in outputs for c in o.outputs]
    stopped = [c for c in samples if c.finish_reason == "stop"]
    assert stopped
    assert all(validates(constraint, c.text) for c in stopped), [c.text for c in stopped]
    free = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40)
    unconstrained = run_to_completion(roomy, prompts(hf_tiny.config.vocab_size), free)
    assert not all(validates(constraint, c.text) for o in unconstrained for c in o.outputs)


class GrammarMask(LogitsProcessor):
    """The oracle's mask: llguidance's byte-per-token logit bias (not the engine's bit
    masks), advanced by each token Hugging Face generated."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, vocab: int):
        self.matcher = LLMatcher(tokenizer, grammar)
        self.vocab = vocab
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        else:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        allowed = llguidance_allowed(self.matcher, self.vocab)
        return scores.masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("name", ["json", "choice", "regex", "lark"])
def test_greedy_constrained_tokens_equal_hf_with_the_same_mask(
    roomy, hf_tiny, tiny_model_dir, name
):
    """The mask applies after the repetition penalty (vLLM's order; HF runs its own
    processors before a custom one) and before the pick: token for token as HF's."""
    constraint = CONSTRAINTS[name]
    grammar = compile_grammar(constraint)
    vocab, eos = hf_tiny.config.vocab_size, hf_tiny.config.eos_token_id
    tokenizer = LLTokenizer(
        (Path(tiny_model_dir) / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos
    )
    params = SamplingParams(
        temperature=0, max_tokens=24, repetition_penalty=1.3, structured_outputs=constraint
    )
    batch = prompts(vocab)
    outputs = run_to_completion(roomy, batch, params)
    for prompt, output in zip(batch, outputs, strict=True):
        with torch.no_grad():
            generated = hf_tiny.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=params.max_tokens,
                do_sample=False,
                repetition_penalty=params.repetition_penalty,
                logits_processor=LogitsProcessorList([GrammarMask(tokenizer, grammar, vocab)]),
                pad_token_id=eos,
            )[0, len(prompt) :].tolist()
        ours = output.outputs[0]
        # The engine ends a complete grammar itself; HF goes on to the EOS it then forces.
        assert generated[: len(ours.token_ids)] == ours.token_ids
        if ours.finish_reason == "stop" and len(generated) > len(ours.token_ids):
            assert generated[len(ours.token_ids)] == eos


def test_preemption_and_prefix_caching_change_no_constrained_token(roomy, hf_tiny, tiny_model_dir):
    """A pool so small that samples are preempted and recomputed, with prefix caching on:
    each sample's matcher goes on where it stopped, so the tokens are those of a roomy run."""
    vocab = hf_tiny.config.vocab_size
    shared = sample_prompts(1, 16, 17, vocab, seed=9)[0]
    batch = [shared + p for p in prompts(vocab)]
    # Outputs longer than max_tokens, so that the sequences outgrow the pool.
    long_outputs = [
        StructuredOutputsParams(regex="[a-z]{90,99}"),
        StructuredOutputsParams(json={"type": "string", "minLength": 90}),
        StructuredOutputsParams(grammar='start: ("ab" | "cd")~50'),
    ]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=32, structured_outputs=c)
        for c in long_outputs
    ]
    expected = run_to_completion(roomy, batch, params)
    tight = engine(
        tiny_model_dir, num_blocks=40, block_size=4, max_model_len=64,
        enable_prefix_caching=True, max_num_batched_tokens=16,
    )  # fmt: skip
    got = run_to_completion(tight, batch, params)
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.num_prefix_cache_hits > 0
    for want, have in zip(expected, got, strict=True):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
    texts = [c.text for o in got for c in o.outputs]
    assert all(re.fullmatch("[a-z]+", t) for t in texts[:2]), texts  # a valid prefix


def test_one_step_ahead_scheduling_changes_no_token(roomy, hf_tiny, tiny_model_dir):
    """Constrained requests run each step applied before the next (their next mask needs the
    last token), beside unconstrained ones that may run ahead: the same tokens as in step."""
    vocab = hf_tiny.config.vocab_size
    params = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=24, structured_outputs=c)
        for c in (CONSTRAINTS["choice"], CONSTRAINTS["regex"])
    ] + [SamplingParams(temperature=1.0, seed=11, max_tokens=24)]
    batch = prompts(vocab)
    expected = run_to_completion(roomy, batch, params)
    ahead = engine(tiny_model_dir, num_blocks=256, block_size=8, async_scheduling=True)
    got = run_to_completion(ahead, batch, params)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids


class BeamGrammarMask(LogitsProcessor):
    """The oracle of constrained beam search: each row's grammar state rebuilt from scratch
    from the tokens that row generated (HF reorders rows as beams), llguidance's own mask."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, vocab: int, prompt_len: int):
        self.tokenizer, self.grammar = tokenizer, grammar
        self.vocab, self.prompt_len = vocab, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            matcher = LLMatcher(self.tokenizer, self.grammar)
            if not matcher.consume_tokens(ids):
                scores[row] = float("-inf")
                continue
            allowed = llguidance_allowed(matcher, self.vocab)
            scores[row] = scores[row].masked_fill(~allowed, float("-inf"))
        return scores


@pytest.mark.parametrize(
    ("name", "tight"),
    [("choice", False), ("regex", False), ("json", False), ("json", True)],
    ids=["choice", "regex", "json", "json-preempting"],
)
def test_constrained_beam_search_equals_hf_with_the_same_mask(
    roomy, hf_tiny, tiny_model_dir, name, tight
):
    """Every beam's grammar state forks with the beam (copied as its blocks are shared):
    sequences and scores as HF's beam search with a processor applying the same grammar to
    each beam, with a pool small enough to preempt too; every finished output is valid."""
    constraint = CONSTRAINTS[name]
    grammar = compile_grammar(constraint)
    vocab, eos = hf_tiny.config.vocab_size, hf_tiny.config.eos_token_id
    tokenizer = LLTokenizer(
        (Path(tiny_model_dir) / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos
    )
    params = BeamSearchParams(
        beam_width=3, max_tokens=16, num_return_sequences=2, structured_outputs=constraint
    )
    batch = prompts(vocab)
    target = (
        engine(tiny_model_dir, num_blocks=26, block_size=4, max_model_len=48) if tight else roomy
    )
    for i, prompt in enumerate(batch):
        target.add_request(f"beam-{i}", prompt, copy.deepcopy(params))
    outputs: dict[str, object] = {}
    while target.has_unfinished_requests():
        for output in target.step():
            if output.finished:
                outputs[output.request_id] = output
    assert target.block_manager.num_free_blocks == target.block_manager.num_usable_blocks
    for i, prompt in enumerate(batch):
        mask = BeamGrammarMask(tokenizer, grammar, vocab, len(prompt))
        expected, scores = hf_beam_search(hf_tiny, prompt, params, LogitsProcessorList([mask]))
        ours = outputs[f"beam-{i}"].outputs
        assert [c.token_ids for c in ours] == expected
        assert [c.score for c in ours] == pytest.approx(scores, abs=1e-4)
        for completion in ours:
            if completion.finish_reason == "stop":
                assert validates(constraint, completion.text), completion.text
    if tight:
        assert target.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_field(roomy, kwargs, field):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ParameterError) as raised:
        roomy.add_request("bad", [1, 2, 3], params)
    assert raised.value.param == field
    assert not roomy.has_unfinished_requests()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: StructuredOutputsParams(regex="a", choice=["b"]), "structured_outputs"),
        (lambda: StructuredOutputsParams(), "structured_outputs"),
        (lambda: StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
        (lambda: StructuredOutputsParams(regex="a" * 70_000), "structured_outputs.regex"),
        (
            lambda: SamplingParams(ignore_eos=True, structured_outputs=CONSTRAINTS["regex"]),
            "ignore_eos",
        ),
        (
            lambda: SamplingParams(min_tokens=2, structured_outputs=CONSTRAINTS["regex"]),
            "min_tokens",
        ),
    ],
)
def test_bad_structured_output_params_name_the_parameter(build, field):
    with pytest.raises(ParameterError) as raised:
        build()
    assert raised.value.param == field


def test_a_grammar_left_without_tokens_fails_its_request_alone(roomy, hf_tiny):
    """allowed_token_ids that exclude every token the grammar allows: that request ends with
    an error once its token is refused, the other request finishes, and every block is back
    (run_to_completion checks the pool)."""
    vocab = hf_tiny.config.vocab_size
    batch = prompts(vocab)[:2]
    starved = SamplingParams(
        temperature=0, max_tokens=8, allowed_token_ids=[0], structured_outputs=CONSTRAINTS["choice"]
    )
    fine = SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"])
    failed, done = run_to_completion(roomy, batch, [starved, fine])
    assert failed.outputs[0].finish_reason == "error"
    assert "grammar" in (failed.error or "")
    assert done.outputs[0].finish_reason == "stop" and done.outputs[0].text in CHOICES
