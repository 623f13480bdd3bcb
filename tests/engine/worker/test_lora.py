"""LoRA adapters (PEFT's format) served over one base model: greedy tokens equal HF's on PEFT's
merged model (`merge_and_unload`), float32, for three adapters of different ranks, targets
and scalings mixed with base requests in one batch, through chunked prefill, preemption,
prefix hits, n > 1 and fewer adapter slots than adapters; an adapter it cannot serve
exactly is refused by name."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from octavo.engine import LLM, LoRARequest, SamplingParams
from octavo.kernels import cpu_ops
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy

MAX_TOKENS = 12
# (name, PEFT LoraConfig settings): ranks 2 to 8; one product, all four (c_proj is both
# attn.c_proj and mlp.c_proj), the MLP; plain and rank-stabilized scaling.
ADAPTERS = [
    ("qkv", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]}),
    ("all", {"r": 8, "lora_alpha": 4, "target_modules": ["c_attn", "c_proj", "c_fc"],
             "use_rslora": True}),
    ("mlp", {"r": 2, "lora_alpha": 16, "target_modules": ["c_fc"]}),
]  # fmt: skip


def make_adapter(base_dir: str, folder: Path, settings: dict, seed: int):
    """A PEFT adapter of the base with random factors (PEFT starts B at zero: a no-op);
    returns PEFT's merged model, the oracle."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(base_dir)
    peft_model = get_peft_model(
        model, LoraConfig(fan_in_fan_out=True, lora_dropout=0.0, **settings)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(folder)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """name -> (LoRARequest, merged HF model)."""
    made = {}
    for lora_int_id, (name, settings) in enumerate(ADAPTERS, start=1):
        folder = tmp_path_factory.mktemp(name)
        merged = make_adapter(tiny_model_dir, folder, settings, seed=lora_int_id)
        made[name] = (LoRARequest(name, lora_int_id, str(folder)), merged)
    return made


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    return sample_prompts(8, 4, 40, hf_tiny.config.vocab_size, seed=21)


def lora_llm(tiny_model_dir, **overrides) -> LLM:
    settings = {
        "model": tiny_model_dir, "device": "cpu", "dtype": "float32", "num_blocks": 256,
        "block_size": 8, "enable_lora": True, "max_loras": 3, "max_lora_rank": 8,
    } | overrides  # fmt: skip
    return LLM(**settings)


def plan(adapters, prompts):
    """Each prompt twice: under an adapter (in turn) or the base, then the same prompt
    under the next: the same tokens under two adapters in one batch."""
    choices = [None, *(adapters[name][0] for name, _ in ADAPTERS)]
    loras = [choices[i % 4] for i in range(len(prompts))]
    loras += [choices[(i + 1) % 4] for i in range(len(prompts))]
    return prompts + prompts, loras


def expected(hf_tiny, adapters, prompts, loras) -> list[list[int]]:
    models = {None: hf_tiny} | {request.lora_int_id: model for request, model in adapters.values()}
    return [
        hf_greedy(models[None if lora is None else lora.lora_int_id], prompt, MAX_TOKENS)
        for prompt, lora in zip(prompts, loras, strict=True)
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill beside other adapters' decodes
        {"num_blocks": 24, "max_model_len": 64},  # preemption by recompute
        {"max_loras": 1},  # one slot: adapters wait for it, slots are reloaded
    ],
    ids=["mixed", "chunked_prefill", "preemption", "one_slot"],
)
def test_mixed_adapters_give_the_merged_models_greedy_tokens(
    tiny_model_dir, hf_tiny, adapters, prompts, overrides
):
    llm = lora_llm(tiny_model_dir, **overrides)
    all_prompts, loras = plan(adapters, prompts)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = expected(hf_tiny, adapters, all_prompts, loras)
    outputs = llm.generate(all_prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outputs] == want
    # The adapters change the tokens: an engine that ignored them would fail.
    assert sum(a != b for a, b in zip(want[: len(prompts)], want[len(prompts) :], strict=True)) > 4
    stats = llm.engine.stats()
    if "num_blocks" in overrides:
        assert stats.num_preemptions > 0
    # A second round: prefix hits, never across adapters.
    again = llm.generate(all_prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in again] == want
    assert llm.engine.stats().num_prefix_cache_hits > stats.num_prefix_cache_hits
    llm.engine.block_manager.check_invariants()


def test_samples_of_an_adapter(tiny_model_dir, hf_tiny, adapters, prompts):
    """n = 3 greedy samples share the adapter of their request."""
    llm = lora_llm(tiny_model_dir)
    lora, merged = adapters["all"]
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts[:3], params, use_tqdm=False, lora_request=lora)
    for prompt, output in zip(prompts[:3], outputs, strict=True):
        assert [o.token_ids for o in output.outputs] == [hf_greedy(merged, prompt, MAX_TOKENS)] * 3


def copy_adapter(adapters, tmp_path: Path, **changes) -> str:
    source = Path(adapters["all"][0].lora_path)
    folder = tmp_path / "changed"
    shutil.copytree(source, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | changes))
    return str(folder)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"c_attn": 2}}, "rank_pattern"),
        ({"bias": "all"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 64}, "max_lora_rank"),
    ],
)
def test_an_adapter_it_cannot_serve_exactly_is_refused_by_name(
    tiny_model_dir, adapters, tmp_path, changes, named
):
    llm = lora_llm(tiny_model_dir)
    request = LoRARequest("bad", 9, copy_adapter(adapters, tmp_path, **changes))
    with pytest.raises(ValueError, match=named) as error:
        llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=request)
    assert getattr(error.value, "param", None) == "lora_path"
    assert not llm.engine.has_unfinished_requests()


def test_missing_folders_other_bases_and_lora_off_are_refused(tiny_model_dir, adapters, tmp_path):
    llm = lora_llm(tiny_model_dir)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="not a folder"):
        llm.generate(["a"], params, use_tqdm=False,
                     lora_request=LoRARequest("x", 5, str(tmp_path / "none")))  # fmt: skip
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        llm.generate(["a"], params, use_tqdm=False,
                     lora_request=LoRARequest("x", 5, tiny_model_dir))  # fmt: skip
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512))
    folder = tmp_path / "other_base"
    get_peft_model(other, LoraConfig(r=2, target_modules=["c_attn"])).save_pretrained(folder)
    with pytest.raises(ValueError, match="another base model"):
        llm.generate(["a"], params, use_tqdm=False, lora_request=LoRARequest("x", 6, str(folder)))
    plain = LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(["a"], params, use_tqdm=False, lora_request=adapters["qkv"][0])


@pytest.mark.parametrize("fused", [True, False], ids=["operator", "twin"])
@pytest.mark.parametrize(
    "token_ids",
    [
        [1, 1, 1, 1],  # one adapter, every row
        [0, 2, 0, 2],  # one adapter beside the base
        [1, 2, 3, 1, 2, 3],  # three adapters, interleaved
        [3, 0, 3, 3, 2] + [1] * 11,  # slots out of order; a slot with more rows than a block
    ],
)
def test_each_row_gets_its_own_adapters_product(
    tiny_model_dir, adapters, token_ids, fused, monkeypatch
):
    """A LoRALinear's output, row by row, against base(x) + x @ A.T @ B.T of the row's
    adapter (none for id 0), by the CPU operator or its torch twin."""
    if fused and not cpu_ops.load():
        pytest.skip("no C++ compiler here: the twin's case covers the path taken")
    if not fused:
        monkeypatch.setattr(cpu_ops, "load", lambda: False)
    llm = lora_llm(tiny_model_dir)
    manager = llm.engine.runner.lora
    assert manager is not None
    requests = {request.lora_int_id: request for request, _ in adapters.values()}
    for request in requests.values():
        manager.add(request)
    layer = manager.layers["h.0.attn.c_attn"]
    device = layer.lora_a.device  # the CPU, or a GPU under --engine-device
    manager.prepare(np.array([3, 2, 1]), device)  # slots: id 1 -> 0, 2 -> 1, 3 -> 2
    ids = np.array(token_ids)
    manager.prepare(ids, device)
    x = torch.randn(len(ids), layer.lora_a.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    with torch.inference_mode():
        got = layer(x)
        base = layer.base(x)
    for row, lora_int_id in enumerate(token_ids):
        want = base[row]
        if lora_int_id:
            from octavo.engine.worker.lora import load_adapter

            adapter = load_adapter(requests[lora_int_id], llm.engine.model_config, 8)
            factors = adapter.weights.get("h.0.attn.c_attn")
            if factors is not None:
                a, b = factors
                want = want + (x[row] @ a.t().to(device)) @ b.t().to(device)
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


def test_beams_of_an_adapter_are_the_merged_models(tiny_model_dir, adapters):
    """Beam search under an adapter (its beams fork and share blocks): HF's beams and scores
    on the merged model."""
    from octavo.engine import BeamSearchParams
    from tests.engine.test_beam_search import hf_beam_search

    lora, merged = adapters["all"]
    llm = lora_llm(tiny_model_dir)
    params = BeamSearchParams(beam_width=3, max_tokens=8, num_return_sequences=2)
    prompts = sample_prompts(3, 4, 20, merged.config.vocab_size, seed=5)
    outputs = llm.beam_search(prompts, params, use_tqdm=False, lora_request=lora)
    for prompt, output in zip(prompts, outputs, strict=True):
        sequences, scores = hf_beam_search(merged, prompt, params)
        assert [o.token_ids for o in output.outputs] == sequences
        assert [o.score for o in output.outputs] == pytest.approx(scores, abs=1e-4)


def one_slot_engine_after_a_step(tiny_model_dir, prompts, loras):
    """An engine of one adapter slot given request r{i} of prompts[i] under loras[i] (None:
    the base), 4 greedy tokens each, after its first step."""
    engine = lora_llm(tiny_model_dir, max_loras=1).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, lora in enumerate(loras):
        engine.add_request(f"r{i}", prompts[i], params, lora_request=lora)
    engine.step()
    return engine


def test_stats_count_running_and_waiting_requests_per_adapter(tiny_model_dir, adapters, prompts):
    """One slot for two adapters: the first's requests run, the second's waits for the
    slot, and the stats say so by adapter id."""
    first, second = adapters["qkv"][0], adapters["all"][0]
    engine = one_slot_engine_after_a_step(tiny_model_dir, prompts, [first, first, second])
    stats = engine.stats()
    assert stats.lora_running == {first.lora_int_id: 2}
    assert stats.lora_waiting == {second.lora_int_id: 1}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().lora_running == {} and engine.stats().lora_waiting == {}


def test_an_id_names_one_adapter(tiny_model_dir, adapters):
    """The prefix cache keys K/V by adapter id: one id with another adapter is refused."""
    llm = lora_llm(tiny_model_dir)
    first, second = adapters["qkv"][0], adapters["mlp"][0]
    params = SamplingParams(max_tokens=2)
    llm.generate(["a"], params, use_tqdm=False, lora_request=first)
    clash = LoRARequest(second.lora_name, first.lora_int_id, second.lora_path)
    with pytest.raises(ValueError, match="another adapter needs another id") as error:
        llm.generate(["a"], params, use_tqdm=False, lora_request=clash)
    assert getattr(error.value, "param", None) == "lora_request"


def test_a_request_whose_adapter_finds_no_slot_does_not_hold_back_others(
    tiny_model_dir, adapters, prompts
):
    """One slot, taken by the first adapter: the second adapter's request is passed over
    (keeping its place), the base request behind it runs, and the second runs once the
    slot frees (the one_slot case above checks the tokens)."""
    first, second = adapters["qkv"][0], adapters["all"][0]
    engine = one_slot_engine_after_a_step(tiny_model_dir, prompts, [first, second, None])
    assert [g.request_id for g in engine.scheduler.running] == ["r0", "r2"]
    assert [g.request_id for g in engine.scheduler.waiting] == ["r1"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_invariants()


def test_logprobs_and_structured_outputs_under_an_adapter(tiny_model_dir, adapters, prompts):
    """Per-token logprobs are the merged model's log-softmax; a JSON-schema constraint holds
    under an adapter as under the base."""
    import jsonschema

    from octavo.engine import StructuredOutputsParams

    lora, merged = adapters["all"]
    llm = lora_llm(tiny_model_dir)
    prompt = prompts[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    [output] = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
    completion = output.outputs[0]
    with torch.no_grad():
        logits = merged(torch.tensor([prompt + completion.token_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        want = logprobs[len(prompt) - 1 + i]
        assert entry[token] == pytest.approx(want[token].item(), abs=1e-4)
        best = sorted(entry.values(), reverse=True)[:2]
        assert best == pytest.approx(want.topk(2).values.tolist(), abs=1e-4)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["a"], "additionalProperties": False}  # fmt: skip
    constrained = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema)
    )
    [output] = llm.generate(["x"], constrained, use_tqdm=False, lora_request=lora)
    jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.parametrize(
    "weights",
    [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]", b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
     b"\x0f\x00\x00\x00\x00\x00\x00\x00" + b'{"a": {"x": 1}}'],
)  # fmt: skip
def test_a_broken_weights_file_is_refused_by_name(tiny_model_dir, adapters, tmp_path, weights):
    folder = copy_adapter(adapters, tmp_path)
    (Path(folder) / "adapter_model.safetensors").write_bytes(weights)
    llm = lora_llm(tiny_model_dir)
    with pytest.raises(ValueError) as error:
        llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("broken", 9, folder))  # fmt: skip
    assert getattr(error.value, "param", None) == "lora_path"


def test_a_truncated_weights_file_is_refused_by_name(tiny_model_dir, adapters, tmp_path):
    """Its header is whole, its tensors are not: found when the factors load."""
    folder = copy_adapter(adapters, tmp_path)
    weights = Path(folder) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    llm = lora_llm(tiny_model_dir)
    with pytest.raises(ValueError) as error:
        llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("cut", 9, folder))  # fmt: skip
    assert getattr(error.value, "param", None) == "lora_path"
    assert llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)  # still serving
