"""Async (one-step-ahead) scheduling on CPU: the lag itself, device-fed inputs, tokens past a
stop discarded, aborts in flight, and requests that need every token first."""

import torch

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import run_to_completion


def make_engine(model_dir, async_scheduling: bool, **overrides) -> LLMEngine:
    config = {"model": model_dir, "device": "cpu", "num_blocks": 256, "block_size": 4}
    return LLMEngine(EngineConfig(**config | overrides, async_scheduling=async_scheduling))


def record_batches(engine: LLMEngine) -> list:
    """Every HostBatch the runner builds, in order."""
    batches = []
    prepare = engine.runner.input_batch.prepare

    def recording(output):
        batches.append(prepare(output))
        return batches[-1]

    engine.runner.input_batch.prepare = recording
    return batches


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_tokens_reach_the_host_one_step_late_and_inputs_come_from_the_device(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    want = run_to_completion(make_engine(tiny_model_dir, False), [prompt], params)[0]
    engine = make_engine(tiny_model_dir, True)
    batches = record_batches(engine)
    engine.add_request("r", prompt, params)
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append([t for o in engine.step() for t in o.outputs[0].token_ids])
    tokens = want.outputs[0].token_ids
    # Step 1 samples token 1 and returns nothing; each later step returns the one before.
    assert per_step == [[], tokens[:1], tokens[:2], tokens[:3], tokens]
    # Four steps ran the model (none wasted past max_tokens); every decode's input token was
    # the previous step's sample, taken on the device.
    assert len(batches) == 4
    assert [len(b.pending_seq_ids) for b in batches] == [0, 1, 1, 1]
    assert all(b.input_ids[b.pending_rows].tolist() == [0] for b in batches[1:])
    assert_all_blocks_free(engine)


def test_a_token_sampled_past_a_stop_is_discarded(eos_model_dir, hf_eos):
    """Sync and async engines run the same requests in differently composed steps: float32,
    whose tokens do not depend on a step's composition (bfloat16's near-ties can: a step of
    a few rows runs fused, a larger one op by op, each rounding in its own order)."""
    prompts = sample_prompts(12, 2, 40, hf_eos.config.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30)
    want = run_to_completion(make_engine(eos_model_dir, False, dtype="float32"), prompts, params)
    engine = make_engine(eos_model_dir, True, dtype="float32")
    batches = record_batches(engine)
    got = run_to_completion(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stopped = [o for o in got if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 3
    # A request that stopped on EOS had one more token sampled, one step ahead, and dropped.
    sampled = sum(len(b.sampled_seq_ids) for b in batches)
    returned = sum(len(o.outputs[0].token_ids) for o in got)
    assert returned < sampled <= returned + len(stopped)
    assert_all_blocks_free(engine)


def test_an_abort_with_a_step_in_flight_frees_everything(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("gone", [1, 2, 3], params)
    engine.add_request("kept", [4, 5, 6, 7], params)
    engine.step()
    engine.step()  # "gone" has a token in flight now
    final = engine.abort_request("gone")
    assert final is not None and final.finished
    assert engine.block_manager.num_usable_blocks - engine.block_manager.num_free_blocks > 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"kept"}
    assert len(outputs[-1].outputs[0].token_ids) == 12
    assert_all_blocks_free(engine)


def test_requests_that_need_every_token_first_run_without_the_lag(tiny_model_dir):
    # A bad word's ban depends on the tokens before it: the host must have them all.
    banning = SamplingParams(temperature=0, max_tokens=10, bad_words=["*)"])
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[9, 9, 8, 9, 8], [1, 2, 3]]
    want = run_to_completion(make_engine(tiny_model_dir, False), prompts, [banning, plain])
    engine = make_engine(tiny_model_dir, True)
    batches = record_batches(engine)
    got = run_to_completion(engine, prompts, [banning, plain])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # While the request with bad words ran, each step was applied before the next was
    # scheduled.
    assert not any(b.pending_seq_ids for b in batches)


def test_penalized_requests_run_a_step_ahead_with_the_tokens_of_hf_and_sync(
    tiny_model_dir, hf_tiny
):
    """Penalties read token counts the sampler keeps on the device, so penalized requests
    take the lag like the rest: greedy with a repetition penalty equals HF generate, and
    seeded samples with frequency and presence penalties equal the engine without the lag."""
    prompts = sample_prompts(3, 4, 12, hf_tiny.config.vocab_size, seed=11)
    repetition = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8)
    sampled = SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=16, frequency_penalty=1.5,
        presence_penalty=-0.5, ignore_eos=True,
    )  # fmt: skip
    params = [repetition, sampled, repetition]
    want = run_to_completion(make_engine(tiny_model_dir, False), prompts, params)
    engine = make_engine(tiny_model_dir, True)
    batches = record_batches(engine)
    got = run_to_completion(engine, prompts, params)
    tokens = [[s.token_ids for s in o.outputs] for o in got]
    assert tokens == [[s.token_ids for s in o.outputs] for o in want]
    assert sum(len(b.pending_seq_ids) for b in batches) > len(batches)  # several rows lagged
    for k in (0, 2):
        with torch.no_grad():
            hf = hf_tiny.generate(
                torch.tensor([prompts[k]]),
                attention_mask=torch.ones(1, len(prompts[k]), dtype=torch.long),
                max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                pad_token_id=hf_tiny.config.eos_token_id,
            )  # fmt: skip
        assert tokens[k][0] == hf[0, len(prompts[k]) :].tolist()
    # The penalties changed the samples: without them the same seeds draw otherwise.
    plain = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    unpenalized = run_to_completion(make_engine(tiny_model_dir, True), [prompts[1]], plain)
    assert [s.token_ids for s in unpenalized[0].outputs] != tokens[1]


def test_no_step_is_scheduled_past_max_model_len(tiny_model_dir, hf_tiny):
    """A pending token that reaches max_model_len (here the model's every position) ends its
    sequence: nothing is scheduled for it, so no position past the model's is computed."""
    n_positions = hf_tiny.config.n_positions
    engine = make_engine(tiny_model_dir, True, num_blocks=512)
    batches = record_batches(engine)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = run_to_completion(engine, [[3] * (n_positions - 2)], params)[0].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
    assert max(int(b.positions.max()) for b in batches) == n_positions - 2


def test_aborting_everything_leaves_nothing_unfinished_and_the_engine_goes_on(tiny_model_dir):
    """A step still in flight for aborted requests only is no unfinished work (as after any
    abort); the next step drops its tokens and serves the next request as usual."""
    engine = make_engine(tiny_model_dir, True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5], params)
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
    want = run_to_completion(make_engine(tiny_model_dir, False), [[7, 8, 9]], params)[0]
    got = run_to_completion(engine, [[7, 8, 9]], params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
