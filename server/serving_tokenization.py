"""POST /tokenize and POST /detokenize (vLLM's tokenization endpoints), and the model card."""

from __future__ import annotations

import time

from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.engine.frontend.tokenizer import Tokenizer
from octavo.server.errors import bad_request
from octavo.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    TokenizeRequest,
    TokenizeResponse,
)
from octavo.server.serving_engine import ServerConfig


class TokenizationServing:
    """Text <-> token ids with the served model's tokenizer, as the engine sees them."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        # When the served model came up: its card says the same on every request.
        self._created = int(time.time())

    def model_cards(self) -> list[ModelCard]:
        """The base model's card, then each LoRA adapter's (its folder as root, the base as
        parent), as vLLM lists them."""
        base = ModelCard(
            id=self.config.served_model_name,
            created=self._created,
            root=self.config.model_root or self.config.served_model_name,
            max_model_len=self.engine.max_model_len,
        )
        cards = [base]
        if self.config.lora is not None:
            cards += [
                ModelCard(
                    id=module.request.lora_name,
                    created=module.created,
                    root=module.request.lora_path,
                    parent=self.config.served_model_name,
                    max_model_len=self.engine.max_model_len,
                )
                for module in self.config.lora.modules()
            ]
        return cards

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        tokenizer = self._tokenizer(request.model, "prompt")
        tokens = tokenizer.encode(request.prompt, request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.engine.max_model_len,
            tokens=tokens,
            token_strs=token_strs,
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        tokenizer = self._tokenizer(request.model, "tokens")
        vocab = self.engine.vocab_size
        bad = [t for t in request.tokens if t >= vocab]
        if bad:
            raise bad_request(f"tokens must be in [0, {vocab}), got {bad[:4]}", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    def _tokenizer(self, model: str | None, param: str) -> Tokenizer:
        if model is not None:  # an adapter shares the base's tokenizer; 404 if unknown
            self.config.lora_request(model)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request(
                "the served model has no tokenizer (tokenizer.json): send token ids", param=param
            )
        return tokenizer
