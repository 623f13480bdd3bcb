"""LoRA adapters served over HTTP (`--enable-lora --lora-modules`): a request picks one by
`model`; requests of two adapters and the base at once give HF's greedy tokens on PEFT's
merged models; /v1/models lists each adapter with the base as its parent; adapters loaded
and unloaded at run time (only with --allow-runtime-lora-updating), bad ones a 4xx naming
the field, and the server whole after."""

import asyncio
from collections.abc import Iterator

import pytest

from octavo.engine.worker.models.model_files import load_model_config
from octavo.server.lora_modules import LoRAModules
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy
from tests.engine.worker.test_lora import ADAPTERS, make_adapter
from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer
from tests.server.test_load_and_disconnect import wait_for_idle

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    """name -> (folder, PEFT's merged model)."""
    made = {}
    for seed, (name, settings) in enumerate(ADAPTERS, start=1):
        folder = tmp_path_factory.mktemp(name)
        made[name] = (str(folder), make_adapter(tiny_model_dir, folder, settings, seed))
    return made


def lora_server(tiny_model_dir, adapter_dirs, runtime: bool) -> InProcessServer:
    modules = LoRAModules(MODEL_NAME, load_model_config(tiny_model_dir, "auto"), max_rank=8)
    for name in ("qkv", "all"):
        modules.add(name, adapter_dirs[name][0])
    return InProcessServer(
        tiny_model_dir,
        engine_args={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
        lora=modules,
        allow_runtime_lora_updating=runtime,
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dirs) -> Iterator[InProcessServer]:
    app = lora_server(tiny_model_dir, adapter_dirs, runtime=True)
    try:
        yield app
    finally:
        app.close()


def complete(server: InProcessServer, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = server.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(server: InProcessServer, token_ids: list[int]) -> str:
    """The text the server makes of tokens (/detokenize: the base's tokenizer)."""
    response = server.http.post("/detokenize", json={"model": MODEL_NAME, "tokens": token_ids})
    return response.json()["prompt"]


def test_requests_of_two_adapters_and_the_base_at_once(server, adapter_dirs, hf_tiny):
    prompts = sample_prompts(6, 4, 30, hf_tiny.config.vocab_size, seed=8)
    models = [MODEL_NAME, "qkv", "all"] * 2
    oracles = {MODEL_NAME: hf_tiny, "qkv": adapter_dirs["qkv"][1], "all": adapter_dirs["all"][1]}

    async def all_at_once():
        bodies = [
            {"model": m, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
             "ignore_eos": True}
            for m, p in zip(models, prompts, strict=True)
        ]  # fmt: skip
        return await asyncio.gather(
            *(server.client.post("/v1/completions", json=b) for b in bodies)
        )

    responses = server.run(all_at_once())
    for model, prompt, response in zip(models, prompts, responses, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == model
        expected = hf_greedy(oracles[model], prompt, MAX_TOKENS)
        assert body["choices"][0]["text"] == text_of(server, expected), model
    assert wait_for_idle(server, 5.0)["octavo:kv_cache_usage_perc"] == 0


def test_models_lists_each_adapter_with_the_base_as_parent(server, adapter_dirs):
    cards = {card["id"]: card for card in server.http.get("/v1/models").json()["data"]}
    assert cards[MODEL_NAME]["parent"] is None
    for name in ("qkv", "all"):
        assert cards[name]["parent"] == MODEL_NAME
        assert cards[name]["root"] == adapter_dirs[name][0]
        assert server.http.get(f"/v1/models/{name}").json()["id"] == name
    assert server.http.get("/v1/models/absent").status_code == 404


def test_runtime_load_and_unload(server, adapter_dirs, hf_tiny, tmp_path):
    prompt = sample_prompts(1, 5, 5, hf_tiny.config.vocab_size, seed=4)[0]
    folder, merged = adapter_dirs["mlp"]
    loaded = server.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": folder}
    )
    assert loaded.status_code == 200, loaded.text
    choice = complete(server, "mlp", prompt)["choices"][0]
    assert choice["text"] == text_of(server, hf_greedy(merged, prompt, MAX_TOKENS))
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    gone = server.http.post("/v1/completions", json={"model": "mlp", "prompt": "a"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    again = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert again.status_code == 404
    # Bad loads: a 400 naming the field, nothing registered.
    (tmp_path / "empty").mkdir()
    for body, param in [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "empty")}, "lora_path"),
        ({"lora_name": "qkv", "lora_path": folder}, "lora_name"),
        ({"lora_name": MODEL_NAME, "lora_path": folder}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
    ]:
        response = server.http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert "x" not in {c["id"] for c in server.http.get("/v1/models").json()["data"]}
    assert server.http.get("/health").status_code == 200
    assert wait_for_idle(server, 5.0)["octavo:kv_cache_usage_perc"] == 0


def test_a_rank_above_the_maximum_is_refused(tiny_model_dir, server, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "r16"
    model = GPT2LMHeadModel.from_pretrained(tiny_model_dir)
    get_peft_model(model, LoraConfig(r=16, target_modules=["c_attn"])).save_pretrained(folder)
    response = server.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(folder)}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "lora_path" and "max_lora_rank" in error["message"]


def test_runtime_updates_are_off_by_default(tiny_model_dir, adapter_dirs):
    app = lora_server(tiny_model_dir, adapter_dirs, runtime=False)
    try:
        body = {"lora_name": "mlp", "lora_path": adapter_dirs["mlp"][0]}
        assert app.http.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert (
            app.http.post("/v1/unload_lora_adapter", json={"lora_name": "qkv"}).status_code == 404
        )
        assert complete(app, "qkv", [5, 6, 7])["model"] == "qkv"
    finally:
        app.close()


def test_metrics_count_requests_per_adapter():
    """The engine's per-adapter counts, labelled with the adapters' names (an id no longer
    served keeps its id)."""
    from types import SimpleNamespace

    from octavo.engine.core_messages import EngineStats
    from octavo.server.metrics import ServerMetrics

    stats = EngineStats(
        num_running_seqs=3, num_waiting_requests=1, num_free_blocks=1, num_usable_blocks=2,
        kv_cache_usage=0.5, num_preemptions=0, num_prompt_tokens=0, num_generation_tokens=0,
        num_requests_added=4, num_prefix_cache_queries=0, num_prefix_cache_hits=0,
        num_steps=1, lora_running={1: 2, 2: 1}, lora_waiting={7: 1},
    )  # fmt: skip
    engine = SimpleNamespace(stats=lambda: stats, num_waiting=1)
    text = ServerMetrics(engine, lora_names=lambda: {1: "qkv", 2: "all"}).render().decode()  # type: ignore[arg-type]
    assert 'octavo:lora_requests_running{lora_name="qkv"} 2.0' in text
    assert 'octavo:lora_requests_running{lora_name="all"} 1.0' in text
    assert 'octavo:lora_requests_waiting{lora_name="7"} 1.0' in text
