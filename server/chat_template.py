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

# A value of --chat-template with one of these is a template, not a file name (vLLM's rule).
TEMPLATE_CHARS = "{}\n"


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
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
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
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **extra,
            )
        except Exception as exc:  # noqa: BLE001 -- whatever the template raises on these messages
            raise ParameterError("messages", f"the chat template failed: {exc}") from exc
