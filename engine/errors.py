"""Errors the engine raises for bad requests; the server maps them to OpenAI-shaped 4xx."""

from __future__ import annotations


class ParameterError(ValueError):
    """An invalid request parameter; `param` names it (as the OpenAI error's "param")."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
