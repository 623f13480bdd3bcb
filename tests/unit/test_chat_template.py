"""Chat templates render as transformers' apply_chat_template renders them (the oracle)."""

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from octavo.engine.errors import ParameterError
from octavo.server.chat_template import ChatTemplate

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
