"""speculative_config: vLLM's JSON refused field by field; the n-gram proposer; which
requests speculate."""

import pytest

from octavo.engine import EngineConfig, SamplingParams
from octavo.engine.sampling_params import BeamSearchParams
from octavo.engine.speculative import SpeculativeConfig, can_speculate, propose_ngram


def test_vllms_json_and_its_defaults():
    spec = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,'
        ' "disable_by_batch_size": 8}'
    )
    assert spec == SpeculativeConfig("ngram", 3, 4, 4, 8)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 1}) == (
        SpeculativeConfig("ngram", 1, 5, 5, None)
    )
    # A model implies method "draft_model", as in vLLM.
    draft = SpeculativeConfig.parse({"model": "distilgpt2", "num_speculative_tokens": 4})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == (
        "draft_model",
        "distilgpt2",
        4,
    )
    assert draft == SpeculativeConfig.parse(
        {"method": "draft_model", "model": "distilgpt2", "num_speculative_tokens": 4}
    )


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "model": "distilgpt2", "num_speculative_tokens": 2}, "model"),
        ({"model": "", "num_speculative_tokens": 2}, "model"),
        ({"model": 3, "num_speculative_tokens": 2}, "model"),
        ({"model": "distilgpt2", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
         "prompt_lookup"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "speed": 1}, "speed"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size"),
    ],
)  # fmt: skip
def test_a_wrong_field_is_refused_at_start_by_name(value, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(model="m", speculative_config=value)


def test_the_offline_dict_is_kept_as_vllms_json():
    config = EngineConfig(
        model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert config.speculative == SpeculativeConfig("ngram", 2, 5, 5, None)
    assert EngineConfig(model="m").speculative is None


@pytest.mark.parametrize(
    ("tokens", "low", "high", "draft"),
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 1, 3, [4, 9, 1]),  # the longest suffix that recurs
        ([1, 2, 7, 8, 2, 5, 6, 1, 2], 1, 2, [7, 8, 2]),  # [1, 2] recurs before [2] alone
        ([5, 1, 6, 2, 7, 1, 8, 1], 1, 1, [8, 1]),  # the latest occurrence of [1]
        ([1, 2, 3], 1, 3, []),  # nothing recurs
        ([4, 4, 4, 4], 2, 3, [4]),  # what followed, up to the end
        ([1, 2, 9, 1, 2], 3, 3, []),  # only windows of 3: none recurs
    ],
)
def test_ngram_proposes_what_followed_the_latest_match(tokens, low, high, draft):
    assert propose_ngram(tokens, 3, low, high) == draft


def test_only_samples_that_read_no_output_speculate():
    assert can_speculate(SamplingParams(temperature=0, logprobs=2, stop=["x"]))
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9, seed=3))
    assert can_speculate(SamplingParams(temperature=0.7, n=2))
    assert can_speculate(SamplingParams(temperature=0, best_of=2))
    for params in (
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=0, min_tokens=3),
        BeamSearchParams(beam_width=2),
    ):
        assert not can_speculate(params), params
