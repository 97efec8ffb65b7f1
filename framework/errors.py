"""Exceptions shared by the engine and its front ends."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The client sent something the engine cannot run; ``param`` names the offending field.

    The OpenAI server maps it to HTTP 400 with the OpenAI error object's ``param`` set.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine core process died or stopped answering; requests in flight cannot complete."""


class ServerShuttingDownError(RuntimeError):
    """The server was asked to stop (SIGINT/SIGTERM): requests in flight end with this error (HTTP 503)."""


class EngineGenerateError(RuntimeError):
    """The engine core failed one request (the engine itself keeps running)."""
