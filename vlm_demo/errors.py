"""Typed errors shared by the engine, the backends and every door, each written once with all it means.

An error class is the one home of its facts, as TGI's ``InferError`` is: its stable ``code`` (API clients,
metrics, the Triton wire's ``vlm_demo[code]`` marker), the HTTP ``status`` and OpenAI error ``kind`` that
``/v1`` answers with, and the ``title`` the page and the MCP tool show above the message. The message itself
is written for the person who sees it; every door shows ``str(error)`` as it is. Two facts more are the page's:
whether asking again can help (``retry_helps``: not after the visitor's own input error), and what a visitor
reads instead of a remote model server's transport details (``remote_words``; the details go to the log).

:data:`BY_CODE` lists each class that declares a code, so a server in this package can send an error by its
code and the client raise the same class (:func:`by_code`). A subclass that keeps its parent's code (a
backend's own refinement) is the parent's error on the wire.
"""

from __future__ import annotations

from typing import ClassVar

INVALID = "invalid_request_error"  # OpenAI's error kinds
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"

BY_CODE: dict[str, type[DemoError]] = {}


class DemoError(Exception):
    """Base class: a specific, user-facing failure of one request."""

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 500  # HTTP status on /v1
    kind: ClassVar[str] = SERVER  # OpenAI's error type on /v1
    title: ClassVar[str] = "Error"  # what the page and the MCP tool call it
    retry_helps: ClassVar[bool] = True  # asking again as it stands can end differently (the page offers Retry)
    remote_words: ClassVar[str] = ""  # what a visitor reads when a remote model server fails this way

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in vars(cls):
            BY_CODE.setdefault(cls.code, cls)


class InvalidRequestError(DemoError):
    """The request itself is bad (image, question, parameters); nothing else is affected.

    ``param`` names the input at fault (a sampling parameter such as ``"temperature"``, or
    ``"question"``), so an API can point at the field it came from; ``None`` for the image. It is not
    pickled: across the engine pipe only the message travels.
    """

    code = "invalid_request"
    status = 400
    kind = INVALID
    title = "Invalid input"
    retry_helps = False  # the same input gives the same error

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedError(InvalidRequestError):
    """The request asks for something this server is not set up to do (a server setting, not the
    visitor's input: Think harder with ``--batching dynamic``, a follow-up on a remote model without
    history); the message says which setting."""

    code = "unsupported"
    status = 400
    kind = INVALID
    title = "Not available on this server"


class QueueFullError(DemoError):
    """Too many requests are waiting; retrying later can succeed."""

    code = "server_busy"
    status = 429
    kind = RATE_LIMIT
    title = "Server busy"


class TooManyRequestsError(DemoError):
    """This client already has its share of answers in progress (``--max-per-client``); others go on."""

    code = "too_many_requests"
    status = 429
    kind = RATE_LIMIT
    title = "Too many answers in progress"


class OutOfMemoryError(DemoError):
    """The accelerator ran out of memory for this request even when run on its own."""

    code = "out_of_memory"
    status = 500
    kind = SERVER
    title = "Out of GPU memory"


class RequestCancelledError(DemoError):
    """The client cancelled the request (Stop button, closed tab)."""

    code = "cancelled"
    status = 499  # nobody is listening any more (nginx's code); /v1 sends no body then
    kind = SERVER
    title = "Stopped"


class EngineStoppedError(DemoError):
    """The engine was shut down while the request was waiting or running (the engine process restarts)."""

    code = "engine_stopped"
    status = 503
    kind = SERVER
    title = "Model restarting"
    remote_words = "The model server is restarting; please try again in a minute."


class GenerationError(DemoError):
    """Generation failed for this request for a reason other than memory."""

    code = "generation_failed"
    status = 500
    kind = SERVER
    title = "Generation failed"
    remote_words = "The model server could not finish this answer; please try again."


class BackendUnavailableError(DemoError):
    """A remote backend (Triton) is down, not ready or unreachable."""

    code = "backend_unavailable"
    status = 503
    kind = SERVER
    title = "Model unavailable"
    remote_words = "The model server is not reachable right now; please try again in a minute."


class BackendTimeoutError(DemoError):
    """A remote backend did not answer within the configured timeout."""

    code = "backend_timeout"
    status = 504
    kind = SERVER
    title = "Model timed out"
    remote_words = "The model server took too long to answer; please try again in a minute."


class ZeroGPUError(DemoError):
    """Hugging Face ZeroGPU refused or ended the GPU call behind an answer: the visitor's quota is spent, the call
    asks for more time than the visitor's tier allows, no GPU came free, the GPU worker died. ZeroGPU's own title
    and words are shown (they say how long to wait, or to sign in)."""

    code = "zerogpu"
    status = 429
    kind = RATE_LIMIT
    title = "ZeroGPU"

    def __init__(self, message: str, title: str = "") -> None:
        super().__init__(message)
        if title:
            self.title = title  # type: ignore[misc]  # ZeroGPU's title for this refusal, e.g. "ZeroGPU quota exceeded"


class ModelLoadError(DemoError):
    """The model cannot be loaded as configured (missing folder, no network, no GPU, not Mllama,
    does not fit); the message is one sentence for the operator, with what to do instead."""

    code = "model_load_failed"
    status = 500
    kind = SERVER
    title = "Model not loaded"


RETRY_LATER = frozenset({429, 503})  # statuses whose same request can succeed soon (Retry-After)


def by_code(code: str) -> type[DemoError]:
    """The class that declared ``code``; an unknown code (a newer server's) is a generation failure."""
    return BY_CODE.get(code, GenerationError)
