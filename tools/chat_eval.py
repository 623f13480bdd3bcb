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
"""

from __future__ import annotations

import argparse
import json
import math
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
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    usable = ids.numel() // WINDOW * WINDOW
    windows = ids[:usable].view(-1, WINDOW)
    loss = model(input_ids=windows, labels=windows).loss.item()
    predicted = windows[:, 1:].reshape(-1).tolist()
    predicted_bytes = len(tokenizer.decode(predicted, skip_special_tokens=False).encode())
    bits = loss * len(predicted) / math.log(2)
    return {"loss": round(loss, 4), "bits_per_byte": round(bits / predicted_bytes, 4)}


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
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
