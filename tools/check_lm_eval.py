"""lm-evaluation-harness as a client: its `local-completions` model against a running Octavo
server must give the log-likelihoods of its own `hf` backend on the same checkpoint.

lm-eval is not a dependency of Octavo (it is large); run this by hand after changing the
scoring path, with lm_eval[api] importable next to Octavo's environment:

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm_eval[api]==0.4.13" accelerate
    .venv/bin/python -m octavo serve --port 8011 &          # the embedded default model
    PYTHONPATH=/tmp/lmeval/lib/python3.11/site-packages \\
        .venv/bin/python tools/check_lm_eval.py --base-url http://127.0.0.1:8011

Exits non-zero when a log-likelihood differs by more than --tolerance or a greedy flag
differs.
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--model-name", default="octavo-tiny")
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
    with tempfile.TemporaryDirectory() as tmp:
        folder = hf_folder(args.model_dir, Path(tmp))
        requests = [
            Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
            for i, pair in enumerate(pairs)
        ]
        rolling = [
            Instance(request_type="loglikelihood_rolling", doc={}, arguments=(ROLLING,), idx=0)
        ]
        api = LocalCompletionsAPI(
            base_url=f"{args.base_url}/v1/completions", model=args.model_name,
            tokenizer_backend="huggingface", tokenizer=folder, num_concurrent=1, max_retries=1,
        )  # fmt: skip
        hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=1)
        got = api.loglikelihood(requests) + [(x, None) for x in api.loglikelihood_rolling(rolling)]
        want = hf.loglikelihood(requests) + [(x, None) for x in hf.loglikelihood_rolling(rolling)]
    worst, ok = 0.0, True
    for name, (value, greedy), (expected, expected_greedy) in zip(
        [*pairs, ("rolling", ROLLING)], got, want, strict=True
    ):
        print(f"{name}: octavo {value:.6f} greedy {greedy} | hf {expected:.6f} greedy "
              f"{expected_greedy}")  # fmt: skip
        worst = max(worst, abs(value - expected))
        ok = ok and greedy == expected_greedy
    print(f"max |difference| {worst:.2e}")
    return 0 if ok and worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
