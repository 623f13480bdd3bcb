"""Chat templates: Jinja that turns a conversation into one prompt, rendered as transformers'
`apply_chat_template` renders it (the same sandbox, options and helpers), so a template
written for a Hugging Face tokenizer gives the same text here."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from octavo.engine.errors import ParameterError
from octavo.engine.frontend.tokenizer import load_tokenizer
from octavo.engine.worker.models.model_files import (
    DUMMY_PRESETS,
    load_model_config,
    resolve_model_path,
)

# A value of --chat-template with one of these is a template, not a file name (vLLM's rule).
TEMPLATE_CHARS = "{}\n"
# Where a Hugging Face checkpoint keeps its chat template and special tokens' texts.
TOKENIZER_CONFIG = "tokenizer_config.json"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike Jinja's own tojson it does not escape HTML characters.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A compiled chat template. `render` fills in `messages`, `add_generation_prompt` and the
    model's `bos_token` / `eos_token`; a template that raises (`raise_exception`, a sandbox
    violation, a bad message) is the request's fault: ParameterError naming `messages`."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.source = source
        self.template = environment.from_string(source)  # TemplateSyntaxError: a bad template
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def load(cls, file_or_string: str, **special_tokens: str | None) -> ChatTemplate:
        """--chat-template's value: a file holding the template, or the template itself."""
        path = Path(file_or_string)
        if not any(c in file_or_string for c in TEMPLATE_CHARS):
            if not path.is_file():
                raise ValueError(
                    f"--chat-template {file_or_string!r} is neither a readable file nor a "
                    "Jinja template"
                )
            return cls(path.read_text(encoding="utf-8"), **special_tokens)
        return cls(file_or_string, **special_tokens)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt of `messages`; `extra` are more template variables (they may override
        bos_token / eos_token, as in transformers)."""
        try:
            # As transformers: extra variables may override the special tokens, never these.
            context = {**self.special_tokens, **extra}
            return self.template.render(
                context, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 -- whatever the template raises on these messages
            raise ParameterError("messages", f"the chat template failed: {exc}") from exc


def load_chat_template(flag: str | None, model: str, load_format: str) -> ChatTemplate | None:
    """The served model's chat template: --chat-template when given, else the checkpoint's
    own (tokenizer_config.json's `chat_template`, as transformers reads it), else None (GPT-2
    has none). Its bos_token / eos_token are tokenizer_config.json's, else the texts of
    config.json's BOS and EOS ids. ValueError for an unreadable or invalid template."""
    tokenizer_config: dict[str, Any] = {}
    if not (load_format == "dummy" and model in DUMMY_PRESETS):
        path = resolve_model_path(model) / TOKENIZER_CONFIG
        if path.is_file():
            tokenizer_config = json.loads(path.read_text(encoding="utf-8"))
    source = flag if flag is not None else _checkpoint_template(tokenizer_config)
    if source is None:
        return None
    config = load_model_config(model, load_format)
    tokenizer = load_tokenizer(model, load_format)
    special_tokens: dict[str, str | None] = {}
    for name, token_id in (("bos_token", config.bos_token_id), ("eos_token", config.eos_token_id)):
        text = _token_content(tokenizer_config.get(name))
        if text is None and tokenizer is not None and token_id is not None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        special_tokens[name] = text
    try:
        if flag is not None:
            return ChatTemplate.load(flag, **special_tokens)
        return ChatTemplate(source, **special_tokens)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from exc


def _checkpoint_template(tokenizer_config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates (the "default")."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
