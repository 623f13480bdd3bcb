"""Structured outputs: the constraint a request puts on the text it generates (vLLM's
`StructuredOutputsParams`), and the llguidance grammar that enforces it.

The front end turns a constraint into grammar text and validates it (`compile_grammar`,
cached), so a bad schema, regex or grammar is refused before anything is queued and the core
receives only the grammar text (`ProcessedPrompt.grammar`, carried by the core request). The
worker keeps one matcher per sampled sequence or beam, built from that text, and masks their
logits each step (engine/worker/grammar.py).
"""

from __future__ import annotations

import functools
import json as jsonlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, grammar_from

from octavo.engine.errors import ParameterError

if TYPE_CHECKING:  # a TypedDict of the type stubs only
    from llguidance._lib import JsonCompileOptions

# The most characters a constraint may have (a schema as JSON text, a regex, a grammar, the
# choices together): it is compiled on the front end (over HTTP in a thread, under a time
# bound), so its size is bounded there too.
MAX_CONSTRAINT_CHARS = 64 * 1024
# Grammars compiled and validated, kept by their text: a client that sends the same schema
# with every request pays for it once.
COMPILED_GRAMMAR_CACHE_SIZE = 256
# JSON without free whitespace between tokens: a model may otherwise fill its whole budget
# with blank lines that every schema allows (a schema can ask for it with "x-guidance").
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# "Any JSON object" (OpenAI's response_format json_object), as a schema.
_ANY_JSON_OBJECT = {"type": "object"}


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as an object or its JSON text),
    `json_object` (any JSON object), `regex` (the whole output matches it), `choice` (the
    output is one of these strings) or `grammar` (a Lark grammar, or GBNF/EBNF as llama.cpp
    writes them). Every invalid value raises ParameterError naming the field."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ParameterError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}",
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ParameterError(self.field, "structured_outputs.json must be a JSON schema")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParameterError(self.field, f"structured_outputs.{name} must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ParameterError(
                self.field, "structured_outputs.choice must be a list of non-empty strings"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ParameterError(self.field, "structured_outputs.json_object must be true")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ParameterError(
                self.field, f"{self.field} is longer than {MAX_CONSTRAINT_CHARS} characters"
            )

    @property
    def kind(self) -> str:
        """The name of the field that is set."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def field(self) -> str:
        """The parameter an error names."""
        return f"structured_outputs.{self.kind}"

    @property
    def text(self) -> str:
        """The constraint as one string: what is compiled, and what the cache is keyed by."""
        if self.json is not None:
            return self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)
        if self.choice is not None:
            return jsonlib.dumps(self.choice)
        if self.json_object:
            return jsonlib.dumps(_ANY_JSON_OBJECT)
        value = self.regex if self.regex is not None else self.grammar
        assert value is not None
        return value


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of `params`, validated; ParameterError naming the field
    (with llguidance's message) when the schema, regex or grammar is invalid."""
    error, grammar = _compile(params.kind, params.text)
    if error:
        raise ParameterError(params.field, f"{params.field} is invalid: {error}")
    return grammar


@functools.lru_cache(maxsize=COMPILED_GRAMMAR_CACHE_SIZE)
def _compile(kind: str, text: str) -> tuple[str, str]:
    """(error, grammar): an error message and "" when the constraint does not compile."""
    try:
        if kind in ("json", "json_object"):
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        else:  # "regex", "choice" (a JSON list), "grammar" (Lark or GBNF)
            grammar = grammar_from(kind, text)  # type: ignore[arg-type]
    except ValueError as exc:  # a schema that is not JSON, a grammar in no known syntax
        return str(exc), ""
    return LLMatcher.validate_grammar(grammar), grammar
