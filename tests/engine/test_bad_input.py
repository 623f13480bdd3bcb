"""Bad requests raise ValueError naming the parameter; the engine keeps serving the rest."""

import pytest

from octavo.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import hf_greedy


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"top_k": 2**63}, "top_k"),  # the sampler's int64 column cannot hold it
        ({"top_k": -(2**63) - 1}, "top_k"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_running_requests_are_unharmed(tiny_model_dir, hf_tiny):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir, device="cpu", num_blocks=64, block_size=8, max_model_len=100
        )
    )
    good_prompt = [3, 4, 5, 6]
    params = SamplingParams(temperature=0, max_tokens=12)
    engine.add_request("good", good_prompt, params)
    engine.step()
    vocab = hf_tiny.config.vocab_size
    bad = [
        ([1] * 101, "max_model_len"),
        ([], "prompt"),
        ("", "prompt"),
        ([1, vocab], "prompt"),
        ([1, -1], "prompt"),
        ("not a list", None),
        ([1.5, 2], "prompt"),
    ]
    for i, (prompt, name) in enumerate(bad):
        if name is None:  # a string is a valid prompt: this one must be accepted
            engine.add_request(f"ok-{i}", prompt, params)
            continue
        with pytest.raises(ValueError, match=name):
            engine.add_request(f"bad-{i}", prompt, params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad-stop", [1], SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", [1], params)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("too-many", [1] * 90, SamplingParams(n=8, max_tokens=10))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        engine.block_manager.check_invariants()
    assert set(outputs) == {"good", "ok-5"}
    assert outputs["good"].outputs[0].token_ids == hf_greedy(hf_tiny, good_prompt, 12)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_llm_generate_validates_all_prompts_before_running_any(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", num_blocks=64, block_size=8)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"block_size": 12}, "block_size"),
        ({"max_model_len": 10_000}, "max_model_len"),
        ({"num_blocks": 3}, "num_blocks"),
        ({"dtype": "int8"}, "dtype"),
        ({"load_format": "pt"}, "load_format"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_bad_engine_config_is_refused_by_name(tiny_model_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", **kwargs))


def test_abort_frees_blocks_and_reports_abort(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=80, block_size=4)
    )
    engine.add_request("a", [1] * 30, SamplingParams(max_tokens=50, n=2, ignore_eos=True))
    engine.add_request("b", [2] * 10, SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks < bm.num_usable_blocks
    final = engine.abort_request("a")
    assert final.finished and {o.finish_reason for o in final.outputs} == {"abort"}
    engine.abort_request("b")
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not engine.has_unfinished_requests() and engine.abort_request("a") is None
