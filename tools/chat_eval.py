"""How well a checkpoint of the embedded model does what it was trained for, on data it never
saw: the held-out reference text's loss (per token, and in bits per byte, which compares
checkpoints with different tokenizers), and held-out synthetic conversations (values the
training dialogues never contain) served through Octavo's offline engine, greedy.

    .venv/bin/python -m tools.chat_eval --model server/default_model

Conversation figures, each a fraction of its turns:
- `tool_call_named`: a turn that should call a tool writes one valid Hermes call with the
  right name; `tool_call_exact`: and exactly the right arguments;
- `answer_quotes_result`: an answer after a tool's result quotes the result;
- `turn_ends`: a turn ends with the template's end token before `MAX_TOKENS`;
- `text_without_call`: a turn that should answer in text calls no tool.

And, teacher-forced (one forward pass per conversation, cheap enough to print while training):
`copied`, of held-out tool conversations, the fraction of each span the model must copy (the
call's tool name, its arguments' values, the answer's quote of the result) whose every token is
the model's argmax given the true tokens before it. Greedy decoding writes a span right only if
this holds for it.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.chat_corpus import DialogueMaker

MAX_TOKENS = 160
WINDOW = 128  # the reference text's loss over windows this long, as training has always used


@torch.no_grad()
def reference_loss(model_dir: Path, text: str) -> dict[str, float]:
    """The mean loss over non-overlapping WINDOW-token windows of `text`, and the same
    loss in bits per byte of the text the windows predict."""
    import tokenizers
    from transformers import GPT2LMHeadModel

    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    return text_loss(model, tokenizer, text)


@torch.no_grad()
def text_loss(model, tokenizer, text: str) -> dict[str, float]:
    """`reference_loss` of a model in memory (its mode left as it was)."""
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    usable = ids.numel() // WINDOW * WINDOW
    windows = ids[:usable].view(-1, WINDOW)
    training = model.training
    loss = model.eval()(input_ids=windows, labels=windows).loss.item()
    model.train(training)
    predicted = windows[:, 1:].reshape(-1).tolist()
    predicted_bytes = len(tokenizer.decode(predicted, skip_special_tokens=False).encode())
    bits = loss * len(predicted) / math.log(2)
    return {"loss": round(loss, 4), "bits_per_byte": round(bits / predicted_bytes, 4)}


@dataclass(frozen=True)
class CopyCase:
    """A rendered held-out tool conversation, its token ids, and each span the model must
    copy, by kind: its text, and the positions of the tokens that spell it."""

    ids: list[int]
    spans: dict[str, list[tuple[str, list[int]]]]


def copy_cases(
    template, tokenizer, texts: list[str], count: int = 96, seed: int = 1, max_len: int = 512
):
    """`count` held-out tool conversations of at most `max_len` tokens (the model's context),
    with their spans."""
    maker = DialogueMaker(texts, seed, held_out=True)
    cases: list[CopyCase] = []
    while len(cases) < count:
        dialogue = maker.tool_dialogue()
        text = template.render(dialogue.messages, False, tools=dialogue.tools)
        encoding = tokenizer.encode(text, add_special_tokens=False)
        if len(encoding.ids) > max_len:
            continue
        [call] = next(m for m in dialogue.messages if m.get("tool_calls"))["tool_calls"]
        start = text.rindex("<tool_call>\n")
        chars: dict[str, list[tuple[int, int]]] = {"tool_name": [], "argument_values": []}
        cursor = text.index(json.dumps(call["function"]["name"]), start) + 1
        chars["tool_name"].append((cursor, cursor + len(call["function"]["name"])))
        for value in call["function"]["arguments"].values():
            at = text.index(json.dumps(value, ensure_ascii=False), cursor) + isinstance(value, str)
            cursor = at + len(str(value))
            chars["argument_values"].append((at, cursor))
        answer = text.rindex("<|im_start|>assistant\n")
        if dialogue.quote and dialogue.quote in text[answer:]:
            at = text.index(dialogue.quote, answer)
            chars["result_quotes"] = [(at, at + len(dialogue.quote))]
        spans = {
            kind: [
                (text[lo:hi], [i for i, (a, b) in enumerate(encoding.offsets) if b > lo and a < hi])
                for lo, hi in ranges
            ]
            for kind, ranges in chars.items()
        }
        cases.append(CopyCase(encoding.ids, spans))
    return cases


@torch.no_grad()
def copied(model, cases: list[CopyCase]) -> dict[str, float]:
    """Teacher-forced: per kind, the fraction of spans whose every token is the argmax."""
    was_training = model.training
    model.eval()
    counts: dict[str, list[int]] = {}
    for case in cases:
        predicted = model(input_ids=torch.tensor([case.ids])).logits[0].argmax(-1).tolist()
        for kind, spans in case.spans.items():
            for _, positions in spans:
                right = all(predicted[i - 1] == case.ids[i] for i in positions)
                counts.setdefault(kind, [0, 0])
                counts[kind][0] += right
                counts[kind][1] += 1
    model.train(was_training)
    return {kind: round(ok / total, 3) for kind, (ok, total) in counts.items()}


def turns(dialogue) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Each assistant turn of a conversation: the messages before it, and the turn."""
    return [
        (dialogue.messages[:i], message)
        for i, message in enumerate(dialogue.messages)
        if message["role"] == "assistant"
    ]


def evaluate_chat(model_dir: Path, texts: list[str], count: int = 300, seed: int = 1) -> dict:
    """Greedy answers to the assistant turns of `count` held-out conversations."""
    from octavo.engine import LLM, SamplingParams
    from octavo.server.chat_template import load_chat_template
    from octavo.server.tool_calls import HermesCalls

    template = load_chat_template(None, str(model_dir), "auto")
    assert template is not None, "the checkpoint has no chat template"
    maker = DialogueMaker(texts, seed, held_out=True)
    cases = []
    for _ in range(count):
        dialogue = maker.dialogue()
        for before, turn in turns(dialogue)[-2:]:  # a history's answers are not the test
            if len(before) < 1 or before[-1]["role"] == "assistant":
                continue
            prompt = template.render(before, True, tools=dialogue.tools or None)
            cases.append((prompt, turn, dialogue))
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", num_blocks=4096)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([prompt for prompt, _, _ in cases], params, use_tqdm=False)
    counts: dict[str, list[int]] = {}

    def count_it(name: str, ok: bool) -> None:
        counts.setdefault(name, [0, 0])
        counts[name][0] += ok
        counts[name][1] += 1

    for (_, turn, dialogue), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        content, calls = HermesCalls().parse(completion.text)
        count_it("turn_ends", completion.finish_reason == "stop")
        if turn.get("tool_calls"):
            expected = turn["tool_calls"][0]["function"]
            named = len(calls) == 1 and calls[0].function.name == expected["name"]
            count_it("tool_call_named", named)
            exact = named and json.loads(calls[0].function.arguments) == expected["arguments"]
            count_it("tool_call_exact", exact)
        else:
            count_it("text_without_call", not calls)
            if dialogue.quote is not None:
                count_it("answer_quotes_result", dialogue.quote in (content or ""))
    return {name: round(ok / total, 3) for name, (ok, total) in counts.items()} | {
        "turns": len(cases)
    }


def copied_by(model_dir: Path, texts: list[str]) -> dict[str, float]:
    """`copied` of a saved checkpoint."""
    import tokenizers
    from transformers import GPT2LMHeadModel

    from octavo.server.chat_template import load_chat_template

    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = load_chat_template(None, str(model_dir), "auto")
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32)
    return copied(model, copy_cases(template, tokenizer, texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("server/default_model"))
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--reference-only", action="store_true")
    args = parser.parse_args()
    from tools.train_default_model import TrainConfig, corpus, split_corpus

    _, chat_texts, heldout = split_corpus(corpus(), TrainConfig.eval_fraction)
    result: dict[str, Any] = {"reference_text": reference_loss(args.model, heldout)}
    if not args.reference_only:
        result |= evaluate_chat(args.model, chat_texts, args.count)
        result["copied"] = copied_by(args.model, chat_texts)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
