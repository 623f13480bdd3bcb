"""Chat templates render as transformers' apply_chat_template renders them (the oracle)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from octavo.engine.errors import ParameterError
from octavo.server.chat_template import ChatTemplate, load_chat_template

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 2's shape: a system prompt folded into the first turn, alternation enforced with
# raise_exception, bos/eos tokens, whitespace control.
LLAMA2 = """{% if messages[0]['role'] == 'system' %}
    {% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = '' %}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + (system if loop.first else '') }}{{ message['content'] }} [/INST]
    {% else %}
        {{ ' ' + message['content'] + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""
# tojson and loop controls.
TOOLISH = """{% for message in messages %}
{% if message['role'] == 'tool' %}{% continue %}{% endif %}
{{ message['role'] }}: {{ message['content'] | tojson }}
{% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief. Ünïcode & <html>"},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A sequence."},
    {"role": "tool", "content": "ignored"},
    {"role": "user", "content": 'And a "tuple"?'},
]


def hf_render(template: str, messages, add_generation_prompt: bool) -> str:
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]")),
        bos_token="<s>",
        eos_token="</s>",
    )
    tokenizer.chat_template = template
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("template", [CHATML, LLAMA2, TOOLISH], ids=["chatml", "llama2", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(template, add_generation_prompt):
    messages = MESSAGES if template is not LLAMA2 else [m for m in MESSAGES if m["role"] != "tool"]
    ours = ChatTemplate(template, bos_token="<s>", eos_token="</s>")
    want = hf_render(template, messages, add_generation_prompt)
    assert ours.render(messages, add_generation_prompt) == want
    assert want  # the oracle rendered something


def test_a_template_that_raises_is_the_requests_fault():
    ours = ChatTemplate(LLAMA2, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ParameterError) as raised:
        ours.render([{"role": "assistant", "content": "first"}])
    assert raised.value.param == "messages" and "alternate" in str(raised.value)


def test_the_sandbox_refuses_python_internals():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ParameterError):
        evil.render(MESSAGES)
    mutating = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(ParameterError):
        mutating.render(MESSAGES)


def test_load_takes_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    from_file = ChatTemplate.load(str(path))
    inline = ChatTemplate.load(CHATML)
    assert from_file.render(MESSAGES) == inline.render(MESSAGES)
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        ChatTemplate.load(str(tmp_path / "missing.jinja"))


def checkpoint_with(tiny_model_dir: str, folder: Path, tokenizer_config: dict | None) -> str:
    """The tiny checkpoint (config and tokenizer) with this tokenizer_config.json."""
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(Path(tiny_model_dir) / name, folder / name)
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder)


def test_a_checkpoint_without_a_template_has_none_unless_the_flag_gives_one(
    tiny_model_dir, tmp_path
):
    model = checkpoint_with(tiny_model_dir, tmp_path, None)
    assert load_chat_template(None, model, "auto") is None
    # The special tokens default to the texts of config.json's BOS and EOS ids.
    flagged = load_chat_template("{{ bos_token }}|{{ eos_token }}", model, "auto")
    assert flagged is not None and flagged.render(MESSAGES) == "<|endoftext|>|<|endoftext|>"


@pytest.mark.parametrize(
    "stored",
    [CHATML, [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]],
    ids=["string", "named"],
)
def test_the_checkpoints_template_and_tokens_are_used(tiny_model_dir, tmp_path, stored):
    config = {"chat_template": stored, "eos_token": {"content": "</s>"}, "bos_token": "<s>"}
    template = load_chat_template(None, checkpoint_with(tiny_model_dir, tmp_path, config), "auto")
    assert template is not None and template.render(MESSAGES) == hf_render(CHATML, MESSAGES, True)
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    # --chat-template wins over the checkpoint's.
    flagged = load_chat_template(LLAMA2, checkpoint_with(tiny_model_dir, tmp_path, config), "auto")
    assert flagged is not None and flagged.source == LLAMA2


def test_an_invalid_template_stops_the_server_at_startup(tiny_model_dir):
    with pytest.raises(ValueError, match="not valid Jinja"):
        load_chat_template("{% for m in messages %}", tiny_model_dir, "auto")
    result = subprocess.run(
        [sys.executable, "-m", "octavo", "serve", "--model", tiny_model_dir, "--device", "cpu",
         "--chat-template", "{% if %}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "not valid Jinja" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
