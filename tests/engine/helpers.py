"""Driving an LLMEngine step by step with the BlockManager's invariants checked every step."""

from __future__ import annotations

import torch

from octavo.engine import LLMEngine, RequestOutput, SamplingParams


def run_to_completion(
    engine: LLMEngine,
    prompts: list[list[int] | str],
    params: SamplingParams | list[SamplingParams],
) -> list[RequestOutput]:
    """Adds every prompt at once, steps until all finish; returns final outputs in order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"req-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
        engine.add_request(request_id, prompt, p)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return [finished[i] for i in ids]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face greedy generate for one prompt alone (stops at EOS like we do)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=hf_model.config.eos_token_id,
        )
    return out[0, len(prompt) :].tolist()


def staggered_greedy(count: int, first: int, step: int) -> list[SamplingParams]:
    """Greedy, EOS ignored, max_tokens first, first + step, ...: requests that end one after
    another, so the running batch changes shape."""
    return [
        SamplingParams(temperature=0, max_tokens=first + step * i, ignore_eos=True)
        for i in range(count)
    ]


def assert_hf_greedy(
    hf_model, prompts: list[list[int]], params: list[SamplingParams], outputs
) -> None:
    """Each output's tokens are HF's greedy continuation of its prompt, max_tokens long."""
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, p.max_tokens)


def llguidance_allowed(matcher, vocab: int) -> torch.Tensor:
    """The tokens an llguidance matcher allows next, bool [vocab], from its byte-per-token
    logit bias: the oracle of the engine's bit masks (a different code path in llguidance)."""
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    return bias[:vocab] > 0
