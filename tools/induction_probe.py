"""Whether a GPT-2 of the embedded model's shape learns to copy (forms induction heads), and how
fast, on the classic task alone: rows packed with random token segments, each repeated at
once. The chat checkpoint needs copying (a tool call's arguments from the question, a tool's
result into the answer), and this measures a training recipe's copying in minutes, apart from
the chat mixture.

Copy accuracy: of the repeats' tokens after their first (the first cannot be known), the
fraction the model's argmax gets right, on held-out rows; printed every 50 steps, the run
ending at --seconds or at 95%.

    .venv/bin/python -m tools.induction_probe --bf16 --seconds 600
    .venv/bin/python -m tools.induction_probe --bf16 --layers 2 --token-range 67
    .venv/bin/python -m tools.induction_probe --bf16 --induction-init --seconds 60
"""

from __future__ import annotations

import argparse
import math
import time

import torch

FIRST_ID = 3  # past the template's special tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--token-range", type=int, default=4096, help="ids drawn below this")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seg-min", type=int, default=4)
    parser.add_argument("--seg-max", type=int, default=24)
    parser.add_argument("--sin-pos", type=float, default=0.0,
                        help="start the position embeddings as sinusoids times this")  # fmt: skip
    parser.add_argument("--induction-init", action="store_true",
                        help="start with tools/induction_init.py's circuit")  # fmt: skip
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def rows(args: argparse.Namespace, generator: torch.Generator, count: int):
    """`count` rows of (segment, segment) pairs, and per token whether it is copyable."""
    ids, masks = [], []
    for _ in range(count):
        row: list[int] = []
        mask: list[int] = []
        while len(row) < args.context:
            k = int(torch.randint(args.seg_min, args.seg_max + 1, (1,), generator=generator))
            segment = torch.randint(FIRST_ID, args.token_range, (k,), generator=generator)
            row += segment.tolist() * 2
            mask += [0] * (k + 1) + [1] * (k - 1)
        ids.append(row[: args.context])
        masks.append(mask[: args.context])
    return torch.tensor(ids), torch.tensor(masks, dtype=torch.bool)


def sinusoids(positions: int, width: int) -> torch.Tensor:
    position = torch.arange(positions, dtype=torch.float32)[:, None]
    rate = torch.exp(-math.log(10000.0) * torch.arange(0, width, 2).float() / width)
    table = torch.zeros(positions, width)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)
    return table


def main() -> None:
    args = parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    held_out, held_out_mask = rows(args, torch.Generator().manual_seed(args.seed + 1), 32)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=512, n_embd=args.embd, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    if args.sin_pos:
        with torch.no_grad():
            model.transformer.wpe.weight.copy_(sinusoids(512, args.embd) * args.sin_pos)
    if args.induction_init:
        from tools.induction_init import write_induction_circuit

        write_induction_circuit(model, torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)  # fmt: skip

    def copy_accuracy() -> float:
        model.eval()
        with torch.no_grad():
            predicted = model(input_ids=held_out).logits[:, :-1].argmax(-1)
        model.train()
        copyable = held_out_mask[:, 1:]
        return (predicted[copyable] == held_out[:, 1:][copyable]).float().mean().item()

    start = time.perf_counter()
    for step in range(args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        batch, _ = rows(args, generator, args.batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            accuracy = copy_accuracy()
            seconds = time.perf_counter() - start
            print(
                f"step {step} loss {loss.item():.3f} copy accuracy {accuracy:.3f} {seconds:.0f} s",
                flush=True,
            )
            if accuracy > 0.95 or seconds > args.seconds:
                break


if __name__ == "__main__":
    main()
