"""lm-evaluation-harness as a client: its `local-completions` model against a running Octavo
server must give the log-likelihoods of its own `hf` backend on the same checkpoint.

lm-eval is not a dependency of Octavo (it is large); run this by hand after changing the
scoring path, with lm_eval[api] importable next to Octavo's environment:

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm_eval[api]==0.4.13" accelerate
    .venv/bin/python -m octavo serve --port 8011 --dtype float32 &   # the embedded model
    PYTHONPATH=/tmp/lmeval/lib/python3.11/site-packages \\
        .venv/bin/python -m tools.check_lm_eval --base-url http://127.0.0.1:8011

Exits non-zero when a log-likelihood differs by more than --tolerance (relative, past one
nat) or a greedy flag differs. It also reports the embedded model's quality as perplexity:
the rolling log-likelihood of the held-out reference text (tools/train_default_model.py's
split, in documents of at most HELDOUT_CHARS), through both backends, in bits per byte
(comparable between checkpoints with different tokenizers).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "server" / "default_model"
PAIRS = [
    ("The class", " definition"),
    ("Lists are", " mutable sequences"),
    ("A function", " returns"),
    ("The café menu", " is long"),
    ("def f(x):", " return x"),
    ("Python is", " a language"),
]
ROLLING = "The class definition of a list in Python is simple and short."
# At most this many characters a held-out document: well under the model's 512 positions in
# tokens, so each is one window (lm-eval's API and HF backends cut longer rolling windows
# differently: the API's first window predicts one token fewer).
HELDOUT_CHARS = 900


def heldout_documents() -> list[str]:
    """The held-out reference text in documents of whole lines, at most HELDOUT_CHARS."""
    from tools.train_default_model import TrainConfig, corpus, split_corpus

    documents, current = [], ""
    for line in split_corpus(corpus(), TrainConfig.eval_fraction)[2].splitlines(keepends=True):
        if current and len(current) + len(line) > HELDOUT_CHARS:
            documents.append(current)
            current = ""
        current += line
    return [*documents, current] if current.strip() else documents


def hf_folder(model_dir: Path, out: Path) -> str:
    """The checkpoint with a transformers tokenizer (lm-eval's hf backend loads one)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    tokenizer.eos_token = tokenizer.bos_token = tokenizer.convert_ids_to_tokens(eos)
    tokenizer.save_pretrained(out)
    for file in model_dir.iterdir():
        if not (out / file.name).exists():
            shutil.copy(file, out)
    return str(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model-name", default="octavo-tiny-chat")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    import httpx
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # One continuation the model itself produces, so that a greedy flag comes out True.
    body = {"model": args.model_name, "prompt": PAIRS[0][0], "max_tokens": 3, "temperature": 0}
    greedy_text = httpx.post(f"{args.base_url}/v1/completions", json=body, timeout=60).json()
    pairs = [*PAIRS, (PAIRS[0][0], greedy_text["choices"][0]["text"])]
    # Rolling windows as long as the model reads (lm-eval's default is 2048 tokens).
    context = json.loads((args.model_dir / "config.json").read_text())["n_positions"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = hf_folder(args.model_dir, Path(tmp))
        requests = [
            Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
            for i, pair in enumerate(pairs)
        ]
        documents = [ROLLING, *heldout_documents()]
        rolling = [
            Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=i)
            for i, text in enumerate(documents)
        ]
        api = LocalCompletionsAPI(
            base_url=f"{args.base_url}/v1/completions", model=args.model_name,
            tokenizer_backend="huggingface", tokenizer=folder, num_concurrent=1, max_retries=1,
            max_length=context,
        )  # fmt: skip
        hf = HFLM(
            pretrained=folder, device="cpu", dtype="float32", batch_size=1, max_length=context
        )
        got = api.loglikelihood(requests) + [(x, None) for x in api.loglikelihood_rolling(rolling)]
        want = hf.loglikelihood(requests) + [(x, None) for x in hf.loglikelihood_rolling(rolling)]
    heldout = len(documents) - 1
    heldout_bytes = sum(len(text.encode()) for text in documents[1:])
    for backend, results in (("octavo", got), ("hf", want)):
        total = sum(value for value, _ in results[-heldout:])
        print(f"held-out reference text, {heldout} documents, {heldout_bytes} bytes: {backend} "
              f"log-likelihood {total:.2f}, {-total / math.log(2) / heldout_bytes:.4f} bits "
              "per byte")  # fmt: skip
    worst, ok = 0.0, True
    names = [*pairs, *(("rolling", text[:24]) for text in documents)]
    for name, (value, greedy), (expected, expected_greedy) in zip(names, got, want, strict=True):
        print(f"{name}: octavo {value:.6f} greedy {greedy} | hf {expected:.6f} greedy "
              f"{expected_greedy}")  # fmt: skip
        # Relative past 1 nat: a document's thousands of nats are sums of float32 terms.
        worst = max(worst, abs(value - expected) / max(1.0, abs(expected)))
        ok = ok and greedy == expected_greedy
    print(f"max difference (relative past 1) {worst:.2e}")
    return 0 if ok and worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
