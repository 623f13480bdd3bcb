"""Prompt logprobs equal Hugging Face's log_softmax over the prompt, position by position,
under chunked prefill, preemption, n > 1 and one-step-ahead scheduling."""

import pytest
import torch

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import TinySpec, make_checkpoint, sample_prompts
from tests.engine.helpers import run_to_completion

NUM_TOP = 3
# Three random models unlike each other: depth, width, heads, vocabulary.
SPECS = {
    "2x64": TinySpec(),
    "1x32": TinySpec(n_layer=1, n_embd=32, n_head=2, seed=1),
    "3x48_vocab300": TinySpec(vocab_size=300, n_layer=3, n_embd=48, n_head=3, seed=2),
}


@pytest.fixture(scope="module", params=list(SPECS))
def model(request, tmp_path_factory):
    """(checkpoint folder, HF model) of one of SPECS."""
    from transformers import GPT2LMHeadModel

    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return folder, GPT2LMHeadModel.from_pretrained(folder).eval()


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is log_softmax of the logits at position p (fp32),
    which score prompt token p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against_hf(hf_model, prompt: list[int], output) -> None:
    """`output.prompt_logprobs` and `prompt_token_ranks` against HF's, position by position."""
    got, ranks = output.prompt_logprobs, output.prompt_token_ranks
    assert len(got) == len(ranks) == len(prompt) and got[0] is None and ranks[0] is None
    expected = hf_prompt_logprobs(hf_model, prompt)
    for position, (entry, rank) in enumerate(zip(got[1:], ranks[1:], strict=True)):
        want = expected[position]
        token = prompt[position + 1]
        assert entry is not None and next(iter(entry)) == token  # the prompt token first
        top = want.topk(NUM_TOP).indices.tolist()
        assert set(entry) == {token, *top}, f"position {position + 1}"
        for token_id, value in entry.items():
            assert value == pytest.approx(want[token_id].item(), abs=1e-4)
        # Tokens within float noise of the prompt token's value may rank either way.
        value = want[token].item()
        assert int((want > value + 1e-4).sum()) + 1 <= rank <= int((want > value - 1e-4).sum()) + 1


def engine_for(folder: str, **overrides) -> LLMEngine:
    config = {"model": folder, "device": "cpu", "dtype": "float32", "num_blocks": 1024,
              "block_size": 8} | overrides  # fmt: skip
    return LLMEngine(EngineConfig(**config))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_num_batched_tokens": 37},  # prompts in uneven chunks, several per step
        {"max_num_batched_tokens": 96, "num_blocks": 40},  # preemption by recompute
        {"max_num_batched_tokens": 37, "async_scheduling": True},
    ],
    ids=["whole", "chunked", "preempting", "chunked_async"],
)
def test_prompt_logprobs_equal_hf_log_softmax(model, overrides):
    folder, hf_model = model
    prompts = sample_prompts(12, 1, 200, hf_model.config.vocab_size, seed=3)
    engine = engine_for(folder, **overrides)
    # Every other request asks, so scoring rows share steps with plain generation.
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       prompt_logprobs=NUM_TOP if i % 2 == 0 else None)
        for i in range(len(prompts))
    ]  # fmt: skip
    outputs = run_to_completion(engine, prompts, params)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if i % 2:
            assert output.prompt_logprobs is None
        else:
            check_against_hf(hf_model, prompt, output)
    if "num_blocks" in overrides:
        assert engine.stats().num_preemptions > 0


def test_n_samples_share_one_prompt_scoring(tiny_model_dir, hf_tiny):
    prompt = sample_prompts(1, 60, 60, hf_tiny.config.vocab_size, seed=4)[0]
    engine = engine_for(tiny_model_dir, max_num_batched_tokens=16)
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, prompt_logprobs=NUM_TOP)
    (output,) = run_to_completion(engine, [prompt], params)
    assert len(output.outputs) == 3
    check_against_hf(hf_tiny, prompt, output)


def test_zero_top_tokens_gives_the_prompt_tokens_alone(tiny_model_dir, hf_tiny):
    prompt = sample_prompts(1, 30, 30, hf_tiny.config.vocab_size, seed=5)[0]
    engine = engine_for(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (output,) = run_to_completion(engine, [prompt], params)
    expected = hf_prompt_logprobs(hf_tiny, prompt)
    assert output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        token = prompt[position + 1]
        assert list(entry) == [token]
        assert entry[token] == pytest.approx(expected[position, token].item(), abs=1e-4)
    assert len(output.prompt_token_ranks) == len(prompt)


def test_streamed_deltas_carry_the_prompt_logprobs_once(tiny_model_dir, hf_tiny):
    from octavo.engine.sampling_params import RequestOutputKind

    prompt = sample_prompts(1, 50, 50, hf_tiny.config.vocab_size, seed=6)[0]
    engine = engine_for(tiny_model_dir, max_num_batched_tokens=16)
    params = SamplingParams(
        temperature=0, max_tokens=5, prompt_logprobs=NUM_TOP, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("r", prompt, params)
    carried = []
    while engine.has_unfinished_requests():
        carried += engine.step()
    assert len(carried) == 5  # one output per token: prompt chunks alone make none
    assert all(o.prompt_logprobs is None and o.prompt_token_ranks is None for o in carried[1:])
    check_against_hf(hf_tiny, prompt, carried[0])
