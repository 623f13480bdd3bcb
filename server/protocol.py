"""OpenAI API shapes (pydantic) shared by the routes, and the completions API's own: requests
validated at the edge, responses. The chat API's are in chat_protocol.py."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from abc import ABC, abstractmethod
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from octavo.engine.sampling_params import INT64_MAX, INT64_MIN
from octavo.engine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# OpenAI caps logprobs at 5 for completions; vLLM allows more. Our sampler takes any N, and
# the top-N is a vocabulary-sized topk, so a generous but bounded cap keeps responses sane.
MAX_LOGPROBS = 20


# Bounds on what one request may carry, checked before anything is queued.
MAX_PROMPTS_PER_REQUEST = 256
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries: bounded at the edge like every list a request carries
MAX_BAD_WORDS = 64
# Fields of vLLM's CompletionRequest that Octavo does not implement yet: a request that sets
# one gets a 400 naming it rather than an answer that silently ignored it.
UNSUPPORTED_VLLM_FIELDS = (
    "guided_decoding_backend", "logits_processors", "spaces_between_special_tokens",
    "add_special_tokens", "return_tokens_as_token_ids", "prompt_embeds",
    "kv_transfer_params", "vllm_xargs",
)  # fmt: skip
# The fields that constrain the output (OpenAI's and vLLM's spellings); at most one per request.
CONSTRAINT_FIELDS = (
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs",
)  # fmt: skip
MAX_CHOICES = 256


def _integral_float_to_int(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer, so this API does too; 1.5, true and "1" stay
    invalid under strict validation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integer fields: a JSON integer, or a float with an integral value (bounds first, so that
# the JSON schema states them).
_INTEGRAL = BeforeValidator(_integral_float_to_int)
PositiveInt = Annotated[int, Field(ge=1), _INTEGRAL]
NonNegativeInt = Annotated[int, Field(ge=0), _INTEGRAL]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX), _INTEGRAL]
LogprobsCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), _INTEGRAL]
# vLLM's request priority: lower is served first (--scheduling-policy priority).
Priority = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), _INTEGRAL]
TokenId = NonNegativeInt


def check_unicode(value: Any, field: str) -> None:
    """Every string a request carries must be encodable (no lone surrogates such as
    "\\ud800", which JSON can express and UTF-8 cannot), in plain data or in models."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{field} is not valid Unicode: {exc.reason}") from None
    elif isinstance(value, list):
        for item in value:
            check_unicode(item, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, field)
            check_unicode(item, field)
    elif isinstance(value, BaseModel):
        check_unicode(value.model_dump(), field)


def field_error(
    field: str, message: str, kind: str | None = None, **context: Any
) -> PydanticCustomError:
    """A model-level validation error (of type `kind`, by default `field`) whose 400 names
    `field` as its param (errors.invalid_body reads the context's field); `message` may
    format {field} and the other `context` values."""
    return PydanticCustomError(kind or field, message, {"field": field, **context})


def valid_unicode(*fields: str) -> Any:
    """A field validator (`_valid_unicode = valid_unicode(...)` in a model): every string
    of `fields` is valid Unicode (`check_unicode`, naming the field)."""

    def check(cls, value, info):
        check_unicode(value, info.field_name)
        return value

    return field_validator(*fields)(check)


def types_only(field: str, allowed: tuple[str, ...], item: str, why: str) -> Any:
    """A before validator (`_name = types_only(...)` in a model): every object of the list
    `field` is of a `type` in `allowed`, else "{item} type ... is not supported: {why}"."""

    def check(cls, value):
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in allowed:
                raise ValueError(f"{item} type {kind!r} is not supported: {why}")
        return value

    return field_validator(field, mode="before")(check)


class RequestModel(BaseModel):
    """A JSON object a request carries, validated strictly: no bool where a number is
    expected or string where a bool is, finite floats only; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(RequestModel):
    """OpenAI's response_format.json_schema: the schema the output must validate against."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # Octavo always enforces the schema (as llguidance compiles it): strict changes nothing.
    strict: bool | None = None

    _valid_unicode = valid_unicode("schema_", "name", "description")


class ResponseFormat(RequestModel):
    """OpenAI's response_format: plain text (the default), any JSON object, or JSON that
    validates against `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputsRequest(RequestModel):
    """vLLM's structured_outputs object: exactly one constraint (engine's
    StructuredOutputsParams)."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @field_validator("json_", "regex", "choice", "grammar")
    @classmethod
    def _valid_unicode(cls, value, info):
        check_unicode(value, f"structured_outputs.{info.field_name.rstrip('_')}")
        return value


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far too.
    continuous_usage_stats: bool = False


class GenerationRequest(RequestModel, ABC):
    """What a completion and a chat completion request share: the model, sampling, stops and
    vLLM's extras, validated strictly at the edge (`RequestModel`), valid Unicode, bounded
    lists. An explicit JSON null means the field's default. Fields that Octavo does not
    implement are refused by name (`UNSUPPORTED`); other unknown fields are ignored with a
    warning, as vLLM does."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = UNSUPPORTED_VLLM_FIELDS

    model: str
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: each prompt token's log-probability, rank and this many best tokens.
    prompt_logprobs: LogprobsCount | None = None
    stop: str | list[str] | None = Field(default=None)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: Seed | None = None
    user: str | None = None
    best_of: PositiveInt | None = None
    # OpenAI's: token id (as a string) -> bias, clamped to [-100, 100].
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's extras
    top_k: TopK = 0
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: PositiveInt | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: Priority = 0
    early_stopping: bool | Literal["never"] = False
    # Structured outputs (CONSTRAINT_FIELDS): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in cls.UNSUPPORTED:
            if data.get(name) not in (None, []):  # an empty list (of tools, say) asks for nothing
                raise field_error(
                    name, "{field} is not supported by this server yet", "unsupported_field"
                )
        unknown = sorted(k for k in data if k not in cls.model_fields)
        if unknown:
            logger.warning("ignoring unknown %s fields: %s", cls.__name__, unknown[:8])
        # null = the default, for every optional field that does not take null itself
        # (max_tokens does: null there means "up to the context length").
        null_means_default = _null_means_default(cls)
        return {
            key: value
            for key, value in data.items()
            if not (value is None and key in null_means_default)
        }

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self.constraint_fields
        if len(given) > 1:
            raise field_error(
                given[1],
                "{field}: only one of response_format, guided_json, guided_regex, "
                "guided_choice, guided_grammar, structured_outputs and a forced tool_choice "
                "may be set",
                "one_constraint",
            )
        return self

    @property
    def constraint_fields(self) -> list[str]:
        """The constraint fields the request sets (response_format "text" sets nothing)."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        return given

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The engine's constraint, from whichever field the client set; ParameterError
        when it is not a valid constraint (naming the engine's field: `client_param` names
        the client's)."""
        given = self.constraint_fields
        if not given:
            return None
        field = given[0]
        value = getattr(self, field)
        if field == "response_format":
            if value.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=value.json_schema.schema_)
        if field == "structured_outputs":  # its fields, by alias, are the engine's
            return StructuredOutputsParams(**value.model_dump(by_alias=True))
        return StructuredOutputsParams(**{field.removeprefix("guided_"): value})

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    _valid_unicode = valid_unicode(
        "model", "user", "logit_bias", "bad_words", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "stop",
    )  # fmt: skip

    # -- what the engine is asked for (the two APIs name some of these differently) ---------

    @abstractmethod
    def max_new_tokens(self) -> int | None:
        """The most tokens to generate; None: up to the context length."""

    @abstractmethod
    def sample_logprobs(self) -> int | None:
        """How many best tokens' log-probabilities each generated token carries (None: no
        log-probabilities at all)."""

    def scored_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: how many best tokens each prompt token is scored
        with (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def client_param(self, param: str) -> str:
        """The request field behind an engine parameter: beam_width is best_of when the
        client sent best_of (else n), num_return_sequences is n, and a structured_outputs
        parameter is the constraint field the client set (`constraint_fields`: a chat
        request's forced tool call is "tools")."""
        if param == "beam_width":
            return "best_of" if self.best_of is not None else "n"
        if param.startswith("structured_outputs"):  # the constraint, as the client sent it
            given = self.constraint_fields
            if given and given[0] != "structured_outputs":
                return given[0]
        return {"num_return_sequences": "n"}.get(param, param)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: one or more prompts (text or token ids) to continue."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # 0 only with echo: score the prompt (prompt logprobs with `logprobs`), generate nothing.
    max_tokens: NonNegativeInt | None = 16
    logprobs: LogprobsCount | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value):
        # A list of token ids is one prompt, bounded by max_model_len; a list of prompts here
        # (never empty: the annotation refuses empty lists).
        many = isinstance(value, list) and len(value) > MAX_PROMPTS_PER_REQUEST
        if many and not isinstance(value[0], int):
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request")
        return value

    _prompt_unicode = valid_unicode("prompt", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):  # one prompt of token ids
            return [[p for p in self.prompt if isinstance(p, int)]]
        return [p for p in self.prompt if not isinstance(p, int)]

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def scored_prompt_logprobs(self) -> int | None:
        # An echoed prompt's tokens get log-probabilities like the generated ones.
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Logprobs(BaseModel):
    """The completions API's logprobs object: one entry per token of the choice (with echo,
    the prompt's tokens first; the first prompt token has null logprobs)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's log-probability at a prompt position, its rank there
    (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # prompt_logprobs (vLLM's shape): per prompt token, null for the first, then
    # {token id: PromptLogprob} for the prompt token and the best tokens at its position.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelPermission(BaseModel):
    """OpenAI's (legacy) permission object, as vLLM fills it."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """A served model, as vLLM lists it: `root` is the checkpoint it was loaded from
    (`vllm bench serve` without --model reads it; an adapter's folder), `parent` the base of
    a LoRA adapter (None for the base)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "octavo"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the adapter at `lora_path` as `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@functools.cache
def _null_means_default(request_class: type[BaseModel]) -> frozenset[str]:
    """A request class's optional fields whose explicit null is replaced by their default
    (those whose type does not take null itself)."""
    return frozenset(
        name
        for name, info in request_class.model_fields.items()
        if not info.is_required() and type(None) not in get_args(info.annotation)
    )


class _TokenizationRequest(RequestModel):
    """What /tokenize and /detokenize share: strict types, an optional model name, and
    every string valid Unicode."""

    model: str | None = None

    _valid_unicode = valid_unicode("*")


class TokenizeRequest(_TokenizationRequest):
    """POST /tokenize (vLLM's): a prompt's token ids under the served model's tokenizer."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_TokenizationRequest):
    """POST /detokenize (vLLM's): the text of token ids."""

    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
