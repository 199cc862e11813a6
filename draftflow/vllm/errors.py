"""Errors raised when talking to vLLM servers; each message says what to fix."""

from __future__ import annotations


class VLLMError(RuntimeError):
    """Base of every error talking to a vLLM server."""


class ServerCheckError(VLLMError):
    """An endpoint cannot be used as asked; the message says exactly what differs."""


class EndpointUnavailable(VLLMError):
    """No connection to the endpoint (after retries)."""


class RequestFailed(VLLMError):
    """The server answered with an HTTP error status (4xx at once, 5xx after retries)."""

    def __init__(self, endpoint: str, status: int, message: str):
        super().__init__(f"{endpoint}: HTTP {status}: {message}")
        self.endpoint, self.status, self.message = endpoint, status, message


class ExtractionNotEnabled(VLLMError):
    """The server answered but wrote no hidden states: it runs without extraction flags."""


class InvalidHiddenStates(VLLMError):
    """A hidden-states file (or the response naming it) failed validation; `reason` says why."""

    def __init__(self, reason: str, path: str | None = None):
        super().__init__(f"{reason} ({path})" if path else reason)
        self.reason, self.path = reason, path
