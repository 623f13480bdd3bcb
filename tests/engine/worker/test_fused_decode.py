"""The fused CPU decode step (engine/worker/fused_decode.py, kernels/cpu/gpt2_decode.cpp)
against its twin, the model's forward op by op: hidden states and the K/V it stores, for one
to eight sequences at different lengths over shuffled block tables, bfloat16 and int8
(bfloat16 and float32 activations), GPT-2 shapes whose widths are no multiple of the
kernels' blocks, GPTBigCode's multi-query and multi-head layouts. Then the engine: which
steps take it, the same greedy tokens as the eager engine, its fallbacks, and bad inputs
refused without touching the cache."""

import pytest
import torch

from octavo.engine import LLM, SamplingParams
from octavo.engine.worker.attention.backend import AttentionMetadata
from octavo.engine.worker.cudagraph_dispatcher import CUDAGraphMode
from octavo.engine.worker.fused_decode import FusedDecode
from octavo.kernels import small_gemm
from tests.checkpoints import TinySpec, make_checkpoint, make_gpt_bigcode_checkpoint

pytestmark = pytest.mark.skipif(
    not {"bfloat16", "int8"} <= small_gemm.kernel_isa(),
    reason="this CPU has no small-row vector kernels (AVX512-BF16, AVX512-VNNI)",
)

BLOCK_SIZE = 4
NUM_BLOCKS = 80
# name: (spec, GPTBigCode multi_query or None for GPT-2)
MODELS = {
    "gpt2": (TinySpec(n_layer=2), None),
    # 40 wide, 5 heads of 8, an MLP of 100: every product's columns and depth padded.
    "gpt2-odd": (TinySpec(n_embd=40, n_head=5, n_inner=100, n_layer=2), None),
    "bigcode-mqa": (TinySpec(n_layer=2), True),
    "bigcode-mha": (TinySpec(n_layer=2), False),
}
SETTINGS = {
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int8-float32": {"dtype": "float32", "quantization": "int8"},
}

# The fused step keeps the residual stream and every intermediate in float32, where the
# eager one rounds them to the model's dtype after each op: with bfloat16 activations the
# two differ by bfloat16's rounding, a few times over (and int8 then quantizes slightly
# different inputs); with float32 activations by the order of float32 sums only.
TOLERANCES = {
    "bfloat16": {"atol": 0.08, "rtol": 0.03},
    "int8": {"atol": 0.15, "rtol": 0.05},
    "int8-float32": {"atol": 1e-4, "rtol": 1e-4},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for name, (spec, multi_query) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        if multi_query is None:
            made[name] = make_checkpoint(folder, spec)
        else:
            made[name] = make_gpt_bigcode_checkpoint(folder, spec, multi_query)
    return made


def _llm(folder: str, **settings) -> LLM:
    return LLM(folder, device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, seed=0,
               **settings)  # fmt: skip


def _decode_inputs(rows: int, seed: int, vocab: int):
    """`rows` sequences of 1 to 30 tokens (the last one this step's), each over blocks drawn
    from a shuffled pool: (input_ids, positions, slot_mapping, block_tables, seq_lens)."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 31, (rows,), generator=generator, dtype=torch.int32)
    width = -(-int(seq_lens.max()) // BLOCK_SIZE)
    pool = torch.randperm(NUM_BLOCKS - 1, generator=generator)[: rows * width] + 1  # not block 0
    block_tables = pool.view(rows, width).to(torch.int32)
    positions = seq_lens.long() - 1
    slots = block_tables.long()[torch.arange(rows), positions // BLOCK_SIZE] * BLOCK_SIZE
    slots += positions % BLOCK_SIZE
    input_ids = torch.randint(0, vocab, (rows,), generator=generator)
    return input_ids, positions, slots, block_tables, seq_lens


def _eager(runner, inputs, kv_cache) -> torch.Tensor:
    input_ids, positions, slots, block_tables, seq_lens = inputs
    rows = len(input_ids)
    metadata = AttentionMetadata(
        slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens,
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32), max_seqlen_q=1,
        max_seqlen_k=int(seq_lens.max()), block_size=BLOCK_SIZE,
        seq_lens_host=seq_lens.tolist(), query_lens_host=[1] * rows, num_decodes=rows,
    )  # fmt: skip
    with torch.inference_mode():
        return runner.model(input_ids, positions, kv_cache, runner.backend.prepare(metadata))


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("model", MODELS)
def test_the_fused_step_is_the_models_forward(folders, model, setting):
    _assert_fused_is_eager(_llm(folders[model], **SETTINGS[setting]), setting)


@pytest.mark.parametrize("setting", SETTINGS)
def test_gelu_inputs_far_below_zero_give_zero_not_nan(tmp_path, setting):
    """Half the MLP's pre-activations at -40, past where the GELU's exp overflows (from
    about -10.3, which a trained 256-wide model reaches): the fused step's states stay the
    op-by-op forward's, finite."""
    from transformers import GPT2LMHeadModel

    folder = make_checkpoint(tmp_path, TinySpec(n_layer=2))
    model = GPT2LMHeadModel.from_pretrained(folder)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_fc.bias[::2] = -40.0
    model.save_pretrained(folder)
    _assert_fused_is_eager(_llm(folder, **SETTINGS[setting]), setting)


def _assert_fused_is_eager(llm: LLM, setting: str) -> None:
    """The fused step's hidden states and stored K/V against the model's forward, for 1, 3
    and MAX_ROWS sequences over a cache of random context."""
    runner = llm.engine.core.runner
    fused = runner.dispatcher.full
    assert isinstance(fused, FusedDecode)
    config = runner.model.config
    generator = torch.Generator().manual_seed(1)
    context = torch.randn(runner.kv_cache.shape, generator=generator).to(runner.kv_cache.dtype)
    for rows in (1, 3, small_gemm.MAX_ROWS):
        inputs = _decode_inputs(rows, rows, config.vocab_size)
        fused_cache, eager_cache = context.clone(), context.clone()
        with torch.inference_mode():
            got = fused.decoder.forward(*inputs[:2], fused_cache, *inputs[2:])
        expected = _eager(runner, inputs, eager_cache)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[setting])
        written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        written[inputs[2]] = True
        flat = (NUM_BLOCKS * BLOCK_SIZE, -1)
        for layer in range(config.n_layer):
            for kv in range(2):
                a = fused_cache[layer, kv].reshape(flat)
                b = eager_cache[layer, kv].reshape(flat)
                assert torch.equal(a[~written], b[~written])  # nothing else touched
                torch.testing.assert_close(
                    a[written].float(), b[written].float(), **TOLERANCES[setting]
                )


@pytest.mark.parametrize("threads", [1, 8])
def test_rows_of_one_sequence_read_the_keys_the_rows_before_them_store(folders, threads):
    """A draft verified position by position: MAX_ROWS rows are consecutive positions of one
    sequence, each reading the keys of the rows before it, which the step stores. Every
    key is stored before any row attends, however the threads share the (row, head) tasks
    (5 heads, more threads than cores): the op-by-op forward's states, which store first."""
    llm = _llm(folders["gpt2-odd"], **SETTINGS["int8-float32"])
    runner = llm.engine.core.runner
    fused = runner.dispatcher.full
    assert isinstance(fused, FusedDecode)
    rows, length = small_gemm.MAX_ROWS, 20
    block_tables = torch.randperm(NUM_BLOCKS - 1)[: -(-length // BLOCK_SIZE)] + 1
    block_tables = block_tables.to(torch.int32).expand(rows, -1).contiguous()
    positions = torch.arange(length - rows, length)
    slots = block_tables[0].long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    input_ids = torch.randint(0, runner.model.config.vocab_size, (rows,))
    inputs = (input_ids, positions, slots, block_tables, (positions + 1).to(torch.int32))
    context = torch.randn(runner.kv_cache.shape).to(runner.kv_cache.dtype)
    fused_cache, eager_cache = context.clone(), context.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = fused.decoder.forward(*inputs[:2], fused_cache, *inputs[2:])
    finally:
        torch.set_num_threads(before)
    expected = _eager(runner, inputs, eager_cache)
    torch.testing.assert_close(got, expected, **TOLERANCES["int8-float32"])


def test_small_decodes_take_the_fused_step_and_give_the_eager_engines_tokens(folders):
    """Greedy tokens of several batch sizes (each fused while at most MAX_ROWS sequences
    decode together) equal the eager engine's, with the cache's blocks all returned. int8
    over float32 activations, where the two compute the same float32 sums (bfloat16 ones
    round differently: test_the_fused_step_is_the_models_forward bounds that, and
    test_default_precision holds the default's tokens to Hugging Face's)."""
    count = small_gemm.MAX_ROWS + 2
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + 2 * i)] for i in range(count)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    int8 = {"quantization": "int8", "dtype": "float32"}
    fused = _llm(folders["gpt2"], **int8)
    eager = _llm(folders["gpt2"], **int8, enforce_eager=True)
    assert eager.engine.core.runner.dispatcher.full is None
    modes = []
    dispatch = fused.engine.core.runner.dispatcher.dispatch

    def spy(num_tokens, uniform_decode, decodes_share_sequences):
        modes.append(dispatch(num_tokens, uniform_decode, decodes_share_sequences))
        return modes[-1]

    fused.engine.core.runner.dispatcher.dispatch = spy
    for count in (1, 3, small_gemm.MAX_ROWS + 2):
        got = fused.generate(prompts[:count], params, use_tqdm=False)
        want = eager.generate(prompts[:count], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert CUDAGraphMode.FULL in modes and CUDAGraphMode.NONE in modes
    manager = fused.engine.core.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


@pytest.mark.parametrize(
    "settings",
    [{"dtype": "float32"}, {"enforce_eager": True}, {"enable_lora": True}],
    ids=["float32", "eager", "lora"],
)
def test_steps_stay_op_by_op_where_the_fused_step_does_not_apply(folders, settings):
    llm = _llm(folders["gpt2"], **settings)
    assert llm.engine.core.runner.dispatcher.full is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_cpu_without_the_kernels_runs_op_by_op(folders, monkeypatch):
    """Where kernel_isa names no kernel, the layers pack no small weights and the engine
    takes every step op by op, with the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _llm(folders["gpt2"], quantization="int8").generate([[5, 6, 7]], params, use_tqdm=False)
    monkeypatch.setattr(small_gemm, "kernel_isa", lambda: frozenset())
    llm = _llm(folders["gpt2"], quantization="int8")
    runner = llm.engine.core.runner
    assert runner.dispatcher.full is None and runner.model.h[0].mlp.c_fc.small is None
    got = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_bad_inputs_are_refused_and_leave_the_cache(folders):
    llm = _llm(folders["gpt2"], dtype="bfloat16")
    runner = llm.engine.core.runner
    decoder = runner.dispatcher.full.decoder
    inputs = _decode_inputs(2, 0, runner.model.config.vocab_size)
    before = runner.kv_cache.clone()
    input_ids, positions, slots, tables, seq_lens = inputs
    cases = {
        "out of range": (input_ids + 10_000, positions, slots, tables, seq_lens),
        "block id": (input_ids, positions, slots, tables.clone().fill_(NUM_BLOCKS), seq_lens),
        "cannot hold": (input_ids, positions, slots, tables[:, :1].contiguous(), seq_lens + 40),
        "1 to 8": tuple(t.repeat(5, *[1] * (t.dim() - 1)) for t in inputs),
    }
    for message, (ids, pos, slot, table, lens) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            decoder.forward(ids, pos, runner.kv_cache, slot, table, lens)
    assert torch.equal(runner.kv_cache, before)
