"""Trains the embedded default model: a tiny GPT-2 on the English reference text of Python,
and on conversations made from that text, so that it chats and calls tools.

The text is `pydoc_data.topics` from the standard library (~466 KB, 79 topics), so training
needs no download. The conversations (tools/chat_corpus.py) are rendered with the model's chat
template (tools/chat_template.jinja: ChatML turns, Hermes tool calls). It writes a Hugging
Face-format folder (config.json, generation_config.json, model.safetensors in float16,
tokenizer.json, tokenizer_config.json with the template) that both Octavo and `transformers`
load, and training.json with the held-out figures (the reference text's loss, and the chat
behaviour and copying of tools/chat_eval.py). Deterministic for a given seed and thread count;
minutes on 2 cores.

    .venv/bin/python -m tools.train_default_model --out server/default_model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.chat_corpus import DialogueMaker

EOS_TOKEN = "<|endoftext|>"
# ChatML's turn markers: special tokens, never in a detokenized text. The Hermes call tags
# stay plain text (merged by BPE like any word), which the hermes parser reads and
# grammars can spell (llguidance takes every added token for a special one).
TURN_TOKENS = ("<|im_start|>", "<|im_end|>")
TEMPLATE = Path(__file__).parent / "chat_template.jinja"


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 4096
    n_positions: int = 512
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 8
    context: int = 512
    batch_size: int = 16
    # Of each batch's rows, packed conversations, and packed "repeat after me" ones: copying
    # is what tool calls and answers need, and a model this small learns it only from many
    # examples. The rest is reference text: few rows, since its 112k tokens are soon read many
    # times over, past which the held-out text's loss grows.
    chat_rows: int = 10
    copy_rows: int = 3
    steps: int = 1200
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    # On the residual stream only: it slows the reference text's memorising; in the
    # attention it would break the copy circuit's sharp patterns.
    resid_pdrop: float = 0.1
    eval_fraction: float = 0.05
    # Conversations beside the reference text that the tokenizer learns its merges from:
    # few, so that the merges stay the reference text's.
    tokenizer_dialogues: int = 200
    # Products in bfloat16 (autocast) where the CPU has bfloat16 units: 1.5x the tokens a
    # second; the weights and the optimizer stay float32.
    bfloat16: bool = False
    # Start from a written copy circuit (tools/induction_init.py): this model and budget do
    # not discover copying by themselves.
    induction_init: bool = True
    seed: int = 0


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def split_corpus(texts: list[str], eval_fraction: float) -> tuple[list[str], list[str], str]:
    """The held-out text is the corpus' last `eval_fraction` of characters. Returns the
    topics the model reads (the one the split cuts, cut), those conversations may draw on
    (the topics that end before the held-out text), and the held-out text."""
    joined = "".join(texts)
    start = int(len(joined) * (1 - eval_fraction))
    reference, chat, offset = [], [], 0
    for text in texts:
        if offset + len(text) <= start:
            reference.append(text)
            chat.append(text)
        elif offset < start:
            reference.append(text[: start - offset])
        offset += len(text)
    return reference, chat, joined[start:]


def chat_template():
    from octavo.server.chat_template import ChatTemplate

    return ChatTemplate(TEMPLATE.read_text(encoding="utf-8"), EOS_TOKEN, TURN_TOKENS[1])


def render(template, dialogue) -> str:
    return template.render(
        dialogue.messages, add_generation_prompt=False, tools=dialogue.tools or None
    )


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *TURN_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    """All topics as one stream, each followed by EOS (the model learns to stop)."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def packed_conversations(tokenizer, template, make, cfg: TrainConfig):
    """Rows of `context` tokens packed with whole conversations, each followed by EOS. Every
    token is learned, not only the assistant's: the prompts' copies (a tool's name in its
    schema's title, its parameters in `required`, a repeated word) teach the copying that
    calls and answers need."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    while True:
        ids: list[int] = []
        while len(ids) < cfg.context:
            text = render(template, make())
            ids += [*tokenizer.encode(text, add_special_tokens=False).ids, eos]
        yield torch.tensor(ids[: cfg.context])


def batches(data: torch.Tensor, chats, copies, cfg: TrainConfig, generator: torch.Generator):
    """Random windows of reference text and packed conversations (HF shifts the labels)."""
    num_text = cfg.batch_size - cfg.chat_rows - cfg.copy_rows
    while True:
        starts = torch.randint(0, data.numel() - cfg.context, (num_text,), generator=generator)
        text = [data[s : s + cfg.context] for s in starts.tolist()]
        chat = [next(chats) for _ in range(cfg.chat_rows)]
        yield torch.stack([*text, *chat, *(next(copies) for _ in range(cfg.copy_rows))])


def learning_rate(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parents[1] / "server" / "default_model"
    )
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    args = parser.parse_args()
    # The tokenizer's thread pool would spin beside torch's threads on a small machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    cfg = TrainConfig(
        steps=args.steps, seed=args.seed, bfloat16=torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )

    from transformers import GPT2Config, GPT2LMHeadModel

    from tools.chat_eval import (
        copied,
        copied_by,
        copy_cases,
        evaluate_chat,
        reference_loss,
        text_loss,
    )
    from tools.induction_init import spaced_pairs, write_induction_circuit

    torch.manual_seed(cfg.seed)
    texts = corpus()
    reference, chat_texts, heldout = split_corpus(texts, cfg.eval_fraction)
    template = chat_template()
    maker = DialogueMaker(chat_texts, cfg.seed)
    sample = [render(template, maker.dialogue()) for _ in range(cfg.tokenizer_dialogues)]
    tokenizer = train_tokenizer([*texts, *sample], cfg.vocab_size)
    train_data = encode_corpus(tokenizer, reference)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=cfg.n_positions,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        bos_token_id=eos,
        eos_token_id=eos,
        resid_pdrop=cfg.resid_pdrop,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).train()
    if cfg.induction_init:
        spaced = spaced_pairs(tokenizer.get_vocab())
        write_induction_circuit(model, torch.Generator().manual_seed(cfg.seed), spaced)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    chats = packed_conversations(tokenizer, template, maker.dialogue, cfg)
    copies = packed_conversations(tokenizer, template, maker.repeat, cfg)
    cases = copy_cases(template, tokenizer, chat_texts)
    start = time.perf_counter()
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"{train_data.numel()} reference text tokens"
    )
    for step, windows in zip(
        range(cfg.steps), batches(train_data, chats, copies, cfg, generator), strict=False
    ):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bfloat16):
            loss = model(input_ids=windows, labels=windows).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == cfg.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s")
            # Copying is learned last, and the reference text soon read many times over: the
            # held-out figures of both, as training goes.
            print(f"step {step:5d}  copied {json.dumps(copied(model, cases))}")
            print(f"step {step:5d}  held-out text {text_loss(model, tokenizer, heldout)}")
    seconds = time.perf_counter() - start

    args.out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(args.out)
    im_end = tokenizer.token_to_id(TURN_TOKENS[1])
    # HF generate and Octavo stop at either: a document's end, or an assistant turn's.
    generation = json.loads((args.out / "generation_config.json").read_text())
    generation["eos_token_id"] = [eos, im_end]
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOS_TOKEN,
                "eos_token": TURN_TOKENS[1],
                "pad_token": EOS_TOKEN,
                "model_max_length": cfg.n_positions,
                "chat_template": TEMPLATE.read_text(encoding="utf-8"),
            },
            indent=2,
        )
        + "\n"
    )
    quality = {
        "reference_text": reference_loss(args.out, heldout),
        **evaluate_chat(args.out, chat_texts),
        "copied": copied_by(args.out, chat_texts),
    }
    print(json.dumps(quality, indent=2))
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "corpus": "pydoc_data.topics + tools/chat_corpus.py",
                "reference_tokens": train_data.numel(),
                "seconds": round(seconds),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                **cfg.__dict__,
                "heldout": quality,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
