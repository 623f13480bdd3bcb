"""OutputProcessor: core token deltas in, text out -- exact stop-string cuts (split across
tokens too), the holdback of possible stop-string prefixes, discarded tokens past a stop, and
delta outputs that concatenate to the final output."""

import copy

import pytest

from octavo.engine.core_messages import EngineCoreOutput, SampleAbort, SampleDelta
from octavo.engine.frontend.output_processor import OutputProcessor
from octavo.engine.frontend.outputs import RequestOutput
from octavo.engine.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from octavo.engine.sampling_params import RequestOutputKind, SamplingParams
from tests.checkpoints import tokenizer_json

TEXT = "Naïve café — ünïcode 日本語 and 🎉 emoji: déjà vu, «quotes» ∑ x² ≤ 10."
DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tokenizer():
    import tokenizers

    return Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json(512)))


def run(tokenizer, text, kind=DELTA, stop_token_ids=(), stream_interval=1, **params):
    """Feeds `text`'s tokens one core step at a time, finishing on a stop token as the core
    would; returns the outputs, the sample aborts asked for and the processor."""
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer, stream_interval)
    sampling = SamplingParams(
        max_tokens=len(ids), output_kind=kind, stop_token_ids=list(stop_token_ids), **params
    )
    processor.add_request("r", None, [1], sampling, 0.0)
    outputs: list[RequestOutput] = []
    aborts: list[SampleAbort] = []
    for i, token in enumerate(ids):
        finish, stop_reason = None, None
        if token in stop_token_ids:
            finish, stop_reason = "stop", token
        elif i == len(ids) - 1:
            finish = "length"
        delta = SampleDelta(0, [token], -float(i), None, finish, stop_reason)
        result = processor.process([EngineCoreOutput("r", [delta], finished=finish is not None)])
        outputs += result.request_outputs
        aborts += result.sample_aborts
        if finish is not None:
            break
    return outputs, aborts, processor


def streamed_text(outputs: list[RequestOutput]) -> str:
    return "".join(c.text for o in outputs for c in o.outputs)


@pytest.mark.parametrize("stop", ["café", "ünï", "日本", " and 🎉", "x²", "u, «", "10."])
def test_stop_strings_cut_exactly_streamed_and_not(tokenizer, stop):
    expected = TEXT[: TEXT.index(stop)]
    outputs, aborts, processor = run(tokenizer, TEXT, stop=[stop, "never appears"])
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert streamed_text(outputs) == expected
    if not TEXT.endswith(stop):  # the core was still running that sample: stop it
        assert aborts == [SampleAbort("r", 0)]
    assert processor.num_unfinished_requests == 0
    whole, _, _ = run(tokenizer, TEXT, FINAL, stop=[stop])
    assert len(whole) == 1 and whole[0].outputs[0].text == expected
    included, _, _ = run(tokenizer, TEXT, FINAL, stop=stop, include_stop_str_in_output=True)
    assert included[0].outputs[0].text == TEXT[: TEXT.index(stop) + len(stop)]


def test_the_earliest_of_several_matches_wins(tokenizer):
    outputs, _, _ = run(tokenizer, "alpha beta gamma", FINAL, stop=["gamma", "beta", "alpha beta"])
    assert outputs[0].outputs[0].stop_reason == "alpha beta" and outputs[0].outputs[0].text == ""


def test_stop_strings_wait_for_min_tokens(tokenizer):
    outputs, _, _ = run(tokenizer, "a b a b a b", FINAL, stop="a", min_tokens=3)
    final = outputs[0].outputs[0]
    assert len(final.token_ids) >= 3 and final.stop_reason == "a"
    assert final.text.count("a") == 1


def test_a_stop_tokens_text_is_dropped_unless_included(tokenizer):
    ids = tokenizer.encode("one two three")
    outputs, aborts, _ = run(tokenizer, "one two three", FINAL, stop_token_ids=[ids[1]])
    final = outputs[0].outputs[0]
    assert final.stop_reason == ids[1] and final.token_ids == ids[:2]
    assert final.text == tokenizer.decode(ids[:1]) and aborts == []  # the core stopped it
    outputs, _, _ = run(
        tokenizer, "one two three", FINAL, stop_token_ids=[ids[1]], include_stop_str_in_output=True
    )
    assert outputs[0].outputs[0].text == tokenizer.decode(ids[:2])


def test_holdback_never_streams_what_a_stop_string_may_still_cut(tokenizer):
    text = "abc abd abc abd"
    stop = "abd!"  # never completes: every "abd" is a prefix that must wait, then go out
    outputs, _, _ = run(tokenizer, text, stop=[stop])
    ids, sent = tokenizer.encode(text), ""
    for i, output in enumerate(outputs[:-1]):
        sent += output.outputs[0].text
        # The last len(stop) - 1 characters could start the stop string: never sent early.
        assert len(sent) <= max(len(tokenizer.decode(ids[: i + 1])) - (len(stop) - 1), 0)
    assert streamed_text(outputs) == text and outputs[-1].outputs[0].finish_reason == "length"
    # Every step that produced a token is an output, even when its text is held back.
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * len(tokenizer.encode(text))


def test_tokens_the_core_computed_past_a_stop_string_are_discarded(tokenizer):
    processor = OutputProcessor(tokenizer)
    x, space, y = tokenizer.encode("x y")
    processor.add_request(
        "r", None, [1], SamplingParams(n=2, stop="y", max_tokens=8, output_kind=DELTA), 0.0
    )

    def step(deltas):
        return processor.process([EngineCoreOutput("r", deltas)])

    first = step([SampleDelta(0, [x], -1.0), SampleDelta(1, [x], -1.0)]).request_outputs
    result = step([SampleDelta(0, [y], -2.0), SampleDelta(1, [space], -2.0)])
    assert result.sample_aborts == [SampleAbort("r", 0)]  # sample 0 hit "y"; 1 goes on
    late = step([SampleDelta(0, [x], -3.0), SampleDelta(1, [x], -3.0)])
    (output,) = late.request_outputs
    assert [c.index for c in output.outputs] == [1] and not output.finished
    final = step([SampleDelta(1, [y], -4.0)]).request_outputs[0]  # 1 hits "y" too
    assert final.finished and processor.num_unfinished_requests == 0
    merged = first[0]
    for output in (*result.request_outputs, *late.request_outputs, final):
        merged.add(output)
    assert [c.token_ids for c in merged.outputs] == [[x, y], [x, space, x, y]]


def test_merged_deltas_concatenate_to_the_final_output(tokenizer):
    outputs, _, _ = run(tokenizer, TEXT, DELTA, stop=["«"], logprobs=0)
    merged = outputs[0]
    for later in outputs[1:]:
        merged.add(later)
    whole, _, _ = run(tokenizer, TEXT, FINAL, stop=["«"], logprobs=0)
    assert merged.outputs == whole[0].outputs and merged.finished


def cut_short(tokenizer, kind, num_tokens: int) -> RequestOutput:
    """The output of a request the core ends (an abort) after `num_tokens` tokens of TEXT,
    its deltas merged."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(output_kind=kind), 0.0)
    outputs = []
    for token in tokenizer.encode(TEXT)[:num_tokens]:
        step = processor.process([EngineCoreOutput("r", [SampleDelta(0, [token], None)])])
        outputs += step.request_outputs
    outputs += processor.process([EngineCoreOutput("r", finished=True)]).request_outputs
    merged = outputs[0]
    for later in outputs[1:]:
        merged.add(later)
    return merged


@pytest.fixture
def decodes(monkeypatch) -> list[tuple[str, int]]:
    """Every detokenizer step and flush from here on: (which, tokens it was given)."""
    calls: list[tuple[str, int]] = []
    for name in ("step", "flush"):
        original = getattr(IncrementalDetokenizer, name)

        def counted(self, output_token_ids, name=name, original=original):
            calls.append((name, len(output_token_ids)))
            return original(self, output_token_ids)

        monkeypatch.setattr(IncrementalDetokenizer, name, counted)
    return calls


@pytest.mark.parametrize("num_tokens", [3, 9, 17, 24])
def test_a_final_only_request_decodes_once_at_its_end_to_the_streamed_text(
    tokenizer, num_tokens, decodes
):
    """FINAL_ONLY without stop strings skips the per-token detokenizer step; its text, ended
    by the core at any token (inside a multi-byte character too) or by a stop token, is the
    text the streamed request built."""
    ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(output_kind=FINAL), 0.0)
    step = processor.process([EngineCoreOutput("r", [SampleDelta(0, ids[:num_tokens], None)])])
    assert step.request_outputs == [] and decodes == []  # nothing decoded yet
    processor.process([EngineCoreOutput("r", finished=True)])
    assert decodes == [("step", num_tokens)]  # at its end, all its tokens at once
    decodes.clear()
    whole = cut_short(tokenizer, FINAL, num_tokens)  # a token a step: still one decode
    assert decodes == [("step", num_tokens)]
    decodes.clear()
    streamed = cut_short(tokenizer, DELTA, num_tokens)  # a decode per token
    assert decodes == [("step", n) for n in range(1, num_tokens + 1)]
    assert whole.outputs == streamed.outputs and whole.outputs[0].finish_reason == "abort"
    for include in (False, True):
        stop = {"stop_token_ids": [ids[num_tokens]], "include_stop_str_in_output": include}
        (whole,) = run(tokenizer, TEXT, FINAL, **stop)[0]
        streamed = run(tokenizer, TEXT, DELTA, **stop)[0]
        assert whole.outputs[0].text == streamed_text(streamed)
        assert whole.outputs[0].token_ids == ids[: ids.index(ids[num_tokens]) + 1]


@pytest.mark.parametrize("interval", [2, 3, 8])
@pytest.mark.parametrize("stop", [None, "日本", " and 🎉", "never appears"])
def test_a_stream_interval_sends_fewer_outputs_that_concatenate_to_the_same(
    tokenizer, interval, stop
):
    """vLLM's --stream-interval: the first token at once, then every `interval` tokens, the
    finish flushing the rest; text (stop strings split across tokens cut the same), token ids
    and logprobs are those of one output per token."""
    params = {"stop": [stop]} if stop else {}
    every, _, _ = run(tokenizer, TEXT, logprobs=1, **params)
    batched, aborts, _ = run(tokenizer, TEXT, stream_interval=interval, logprobs=1, **params)
    for field in ("text", "token_ids", "logprobs"):
        assert [getattr(c, field) for c in merged_outputs(batched)] == [
            getattr(c, field) for c in merged_outputs(every)
        ]
    assert batched[-1].finished and not any(o.finished for o in batched[:-1])
    sizes = [len(o.outputs[0].token_ids) for o in batched]
    assert sizes[0] == 1  # the first token is never held back
    assert all(size == interval for size in sizes[1:-1])
    assert 1 <= sizes[-1] <= interval or len(batched) == 1
    assert len(batched) < len(every)


def test_a_stream_interval_holds_each_sample_on_its_own(tokenizer):
    """n = 2: each sample's first token goes at once, then every `interval` of its tokens."""
    processor = OutputProcessor(tokenizer, stream_interval=3)
    processor.add_request("r", None, [1], SamplingParams(n=2, max_tokens=8, output_kind=DELTA), 0.0)
    sent: dict[int, list[int]] = {0: [], 1: []}
    sizes: dict[int, list[int]] = {0: [], 1: []}
    for step in range(7):  # sample 1 starts a step late and ends with sample 0
        deltas = [SampleDelta(0, [10 + step], -1.0, None, "length" if step == 6 else None)]
        if step >= 1:
            deltas.append(SampleDelta(1, [20 + step], -1.0, None, "length" if step == 6 else None))
        for output in processor.process([EngineCoreOutput("r", deltas)]).request_outputs:
            for completion in output.outputs:
                sent[completion.index] += completion.token_ids
                sizes[completion.index].append(len(completion.token_ids))
    assert sent == {0: [10 + i for i in range(7)], 1: [20 + i for i in range(1, 7)]}
    assert sizes == {0: [1, 3, 3], 1: [1, 3, 2]}


def merged_outputs(outputs: list[RequestOutput]):
    """A stream's delta outputs merged into one output's completions (on copies: merging
    extends the completions it takes in)."""
    merged = RequestOutput(outputs[0].request_id, None, [], [], False)
    for output in copy.deepcopy(outputs):
        merged.add(output)
    return merged.outputs


@pytest.mark.parametrize("interval", [1, 3])
def test_outputs_built_late_hold_every_step_since_the_last_build(tokenizer, interval):
    """A consumer behind the engine: steps applied with `update` and built only every
    fourth step give fewer outputs, which concatenate to exactly what building after every
    step gives (n = 2, logprobs, a stop string split across tokens, a stream interval);
    right after a build nothing is due."""
    ids = tokenizer.encode(TEXT)

    def outputs_built_every(every: int) -> list[RequestOutput]:
        processor = OutputProcessor(tokenizer, interval)
        params = SamplingParams(
            n=2, max_tokens=len(ids), stop=["日本"], logprobs=0, output_kind=DELTA
        )
        processor.add_request("r", None, [1], params, 0.0)
        built, due = [], None
        for i, token in enumerate(ids):
            finish = "length" if i == len(ids) - 1 else None
            other = ids[-1 - i]  # sample 1 decodes the text backwards: it never stops early
            deltas = [
                SampleDelta(k, [t], -float(i), [{t: -1.0}], finish)
                for k, t in enumerate((token, other))
            ]
            updated = processor.update([EngineCoreOutput("r", deltas, finished=bool(finish))])
            assert len(updated.ready) <= 1
            due = updated.ready[0] if updated.ready else due
            if due is not None and (i % every == every - 1 or due.finished):
                output = processor.build(due)
                assert output is not None
                built.append(output)
                if not due.finished:
                    assert processor.build(due) is None
                due = None
            if processor.num_unfinished_requests == 0:
                break
        assert built[-1].finished and not any(o.finished for o in built[:-1])
        return built

    every_step, late = outputs_built_every(1), outputs_built_every(4)
    assert len(late) < len(every_step)
    for field in ("text", "token_ids", "logprobs", "finish_reason", "stop_reason"):
        assert [getattr(c, field) for c in merged_outputs(late)] == [
            getattr(c, field) for c in merged_outputs(every_step)
        ]
    assert merged_outputs(late)[0].text == TEXT[: TEXT.index("日本")]
