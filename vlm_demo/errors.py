"""Typed errors shared by the engine, the backends and the UI.

Each error carries a stable ``code`` (for API clients and metrics) and a message written for the
person who sees it; the UI shows ``str(error)`` as it is.
"""

from __future__ import annotations


class DemoError(Exception):
    """Base class: a specific, user-facing failure of one request."""

    code = "error"


class InvalidRequestError(DemoError):
    """The request itself is bad (image, question, parameters); nothing else is affected.

    ``param`` names the input at fault (a sampling parameter such as ``"temperature"``, or
    ``"question"``), so an API can point at the field it came from; ``None`` for the image. It is not
    pickled: across the engine pipe only the message travels.
    """

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedError(InvalidRequestError):
    """The request asks for something this server is not set up to do (a server setting, not the
    visitor's input: Think harder with ``--batching dynamic``, a follow-up on a remote model without
    history); the message says which setting."""

    code = "unsupported"


class QueueFullError(DemoError):
    """Too many requests are waiting; retrying later can succeed."""

    code = "server_busy"


class TooManyRequestsError(DemoError):
    """This client already has its share of answers in progress (``--max-per-client``); others go on."""

    code = "too_many_requests"


class OutOfMemoryError(DemoError):
    """The accelerator ran out of memory for this request even when run on its own."""

    code = "out_of_memory"


class RequestCancelledError(DemoError):
    """The client cancelled the request (Stop button, closed tab)."""

    code = "cancelled"


class EngineStoppedError(DemoError):
    """The engine was shut down while the request was waiting or running."""

    code = "engine_stopped"


class GenerationError(DemoError):
    """Generation failed for this request for a reason other than memory."""

    code = "generation_failed"


class BackendUnavailableError(DemoError):
    """A remote backend (Triton) is down, not ready or unreachable."""

    code = "backend_unavailable"


class BackendTimeoutError(DemoError):
    """A remote backend did not answer within the configured timeout."""

    code = "backend_timeout"


class ModelLoadError(DemoError):
    """The model cannot be loaded as configured (missing folder, no network, no GPU, not Mllama,
    does not fit); the message is one sentence for the operator, with what to do instead."""

    code = "model_load_failed"
