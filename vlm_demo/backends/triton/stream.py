"""One answer in flight to Triton: the :class:`~vlm_demo.stream.Stream` handle the doors read, fed by the
transport as the remote's responses arrive, and the figures (counts, how the remote engine ran it) read from
whichever contract's names the remote uses."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vlm_demo.errors import RequestCancelledError
from vlm_demo.results import GenerationResult
from vlm_demo.stream import OutputStream, Stream

log = logging.getLogger(__name__)


class TritonStream(OutputStream):
    """A request in flight to Triton, fed by the transport (on its event loop's thread).

    On top of :class:`OutputStream` it keeps a way to abort the remote call (the transport cancels its task:
    the gRPC call or the HTTP response is closed) when it is cancelled; the transport's own deadline ends it
    with :class:`~vlm_demo.errors.BackendTimeoutError`.
    """

    def __init__(self, on_done: Callable[[Stream], None]) -> None:
        super().__init__()
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.text = ""
        # What the remote reports (0: it did not): counts, and how its engine ran the request.
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.batch_size = 0
        self.queue_s = 0.0
        self.decode_s = 0.0  # its decoding seconds after the first token: the span of an honest tokens/s
        self.remote_reason: str | None = None  # the finish reason the remote reported, once it did
        self._abort: Callable[[], object] | None = None
        self.add_done_callback(on_done)

    def cancel(self) -> None:
        """Stop waiting and stop the remote work."""
        if self.fail(RequestCancelledError("Request cancelled.")):
            self._run_abort()

    # ---- transport side ----
    def set_abort(self, abort: Callable[[], object]) -> None:
        """Register how to stop the remote call; runs at once if the request already ended."""
        with self._lock:
            self._abort = abort
            ended = self._done.is_set()
        if ended and self._error is not None:
            self._run_abort()

    def report(self, name: str, value: Any) -> None:
        """Record a figure the remote reported under either contract's ``name`` (see :data:`REPORTED`);
        completion tokens add up, as vLLM streams a count with each response."""
        field = REPORTED[name]
        if field == "completion_tokens":
            self.completion_tokens += int(value)
        else:
            setattr(self, field, float(value) if field.endswith("_s") else int(value))

    def push(self, delta: str) -> None:
        if not delta or self.done:
            return
        if self.first_token is None:
            self.first_token = time.monotonic()
        self.text += delta
        self._send(delta)

    def finish(self, reason: str = "stop") -> bool:
        now = time.monotonic()
        total = now - self.submitted
        return self._end(
            GenerationResult(
                text=self.text,
                finish_reason=reason,
                batch_size=self.batch_size,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                queue_s=self.queue_s,
                ttft_s=(self.first_token or now) - self.submitted,
                total_s=total,
                decode_s=self.decode_s,  # the remote engine's; this side's clock saw pieces arrive, not decoding
                # An engine that ran longer than this request took end to end did not run it: Triton's
                # response cache replayed an earlier answer with that run's figures.
                cached=self.queue_s + self.decode_s > total,
            ),
            None,
        )

    def _run_abort(self) -> None:
        with self._lock:
            abort, self._abort = self._abort, None
        if abort is not None:
            try:
                abort()
            except Exception:
                log.debug("aborting a Triton call failed", exc_info=True)


# The optional figures a remote may report, by the names of either contract -> the TritonStream field.
REPORTED = {
    "PROMPT_TOKENS": "prompt_tokens",
    "COMPLETION_TOKENS": "completion_tokens",
    "BATCH_SIZE": "batch_size",
    "QUEUE_S": "queue_s",
    "DECODE_S": "decode_s",
    "num_input_tokens": "prompt_tokens",
    "num_output_tokens": "completion_tokens",
    "batch_size": "batch_size",
    "queue_s": "queue_s",
    "decode_s": "decode_s",
}


def read_counts(stream: TritonStream, result: Any) -> None:
    """Pick up the optional figures and finish reason whichever contract's names the remote uses."""
    for name in REPORTED:
        value = _maybe_output(result, name)
        if value is not None and value.size:
            stream.report(name, value.reshape(-1)[0])
    reason = _maybe_output(result, "finish_reason")
    if reason is not None and reason.size and text_of(reason):
        stream.remote_reason = _finish_reason(text_of(reason))


def read_event_counts(stream: TritonStream, event: dict[str, Any]) -> None:
    """The same from a ``generate_stream`` event (its outputs are JSON keys)."""
    for name in REPORTED:
        if name in event:
            stream.report(name, _first(event[name]))
    if event.get("finish_reason"):
        stream.remote_reason = _finish_reason(str(_first(event["finish_reason"])))


def _finish_reason(text: str) -> str:
    """vLLM says "length"/"stop"/"abort"; keep the engine's vocabulary."""
    return {"abort": "cancelled"}.get(text, text)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _maybe_output(result: Any, name: str) -> np.ndarray | None:
    try:
        return result.as_numpy(name)
    except Exception:  # tritonclient raises for outputs absent from the response
        return None


def text_of(array: np.ndarray) -> str:
    """A BYTES tensor (any shape) as one string."""
    return "".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in np.ravel(array))


def event_text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return str(value)
