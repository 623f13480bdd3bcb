"""Trains the embedded default model: a tiny GPT-2 on the English reference text of Python.

The text is `pydoc_data.topics` from the standard library (~466 KB, 79 topics), so training
needs no download. It writes a Hugging Face-format folder (config.json,
generation_config.json, model.safetensors in float16, tokenizer.json) that both Octavo and
`transformers` load. Deterministic for a given seed and thread count; a few minutes on 2 cores.

    .venv/bin/python -m tools.train_default_model --out server/default_model
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 4096
    n_positions: int = 512
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    context: int = 128
    batch_size: int = 32
    steps: int = 600
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    eval_fraction: float = 0.05
    seed: int = 0


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
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


def batches(data: torch.Tensor, cfg: TrainConfig, generator: torch.Generator):
    """Random windows of `context` tokens; HF shifts the labels itself, so labels = inputs."""
    while True:
        starts = torch.randint(
            0, data.numel() - cfg.context, (cfg.batch_size,), generator=generator
        )
        yield torch.stack([data[s : s + cfg.context] for s in starts.tolist()])


def learning_rate(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig) -> float:
    model.eval()
    usable = (data.numel() - 1) // cfg.context * cfg.context
    windows = data[:usable].view(-1, cfg.context)
    loss = model(input_ids=windows, labels=windows).loss.item()
    model.train()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "default_model")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    args = parser.parse_args()
    cfg = TrainConfig(steps=args.steps, seed=args.seed)

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(cfg.seed)
    texts = corpus()
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    data = encode_corpus(tokenizer, texts)
    split = int(data.numel() * (1 - cfg.eval_fraction))
    train_data, eval_data = data[:split], data[split:]
    eos = tokenizer.token_to_id(EOS_TOKEN)
    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=cfg.n_positions,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        bos_token_id=eos,
        eos_token_id=eos,
        # Dropout slows a 1M-parameter model down far more than it helps it generalise.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    start = time.perf_counter()
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"{train_data.numel()} training tokens"
    )
    for step, windows in zip(range(cfg.steps), batches(train_data, cfg, generator), strict=False):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        loss = model(input_ids=windows, labels=windows).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == cfg.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s")
    eval_loss = evaluate(model, eval_data, cfg)
    print(f"eval loss {eval_loss:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(args.out)
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "corpus": "pydoc_data.topics",
                "train_tokens": train_data.numel(),
                "eval_tokens": eval_data.numel(),
                "eval_loss": round(eval_loss, 4),
                "seconds": round(time.perf_counter() - start),
                "torch": torch.__version__,
                **cfg.__dict__,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
