"""The demo's backend when ``--triton-url`` is set: every request goes to a remote Triton model, behind the
same interface as the local engine.

Two contracts are spoken (``--triton-protocol auto`` picks one from the model's metadata): ``infer``
(:mod:`.infer`) and ``generate`` (:mod:`.generate`), over HTTP or gRPC (:mod:`.transport`). Each request is
a task on the backend's one event loop, not a thread: its inputs are prepared on the caller's thread (the
image encoded), then the task sends them and feeds the answer's stream; the deadline (``--triton-timeout``)
and Stop cancel the task, which stops the remote call.

The status line reports what the remote engine measured (batch size, tokens, decoding time); what a remote
does not report is left out rather than guessed from this side's clock. A model whose config names the tiny
model (``parameters { key: "model" ... }``) gets the tiny model's banner. Fair share and the per-client cap
live in front of every backend (:mod:`vlm_demo.web.answers`); Triton's scheduler orders the requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vlm_demo.backends.base import Features, Health, RemoteStatus
from vlm_demo.backends.triton import generate, infer
from vlm_demo.backends.triton.remote import (
    Endpoint,
    ModelInfo,
    TritonStarting,
    check_ready,
    inspect_model,
    to_demo_error,
)
from vlm_demo.backends.triton.stream import TritonStream
from vlm_demo.backends.triton.transport import Loop, Transport, connect
from vlm_demo.config import Config
from vlm_demo.errors import (
    BackendTimeoutError,
    DemoError,
    EngineStoppedError,
    QueueFullError,
    RequestCancelledError,
    UnsupportedError,
)
from vlm_demo.models.choice import remote_notice
from vlm_demo.request import ValidRequest
from vlm_demo.results import GenerationResult, LoadProgress
from vlm_demo.stream import Listener, Listeners, Stream, run_all
from vlm_demo.triton import contract

log = logging.getLogger(__name__)


class TritonBackend:
    """Forwards each request to the remote model; see the module's docstring."""

    name = "triton"
    remote = True

    def __init__(self, config: Config, endpoint: Endpoint, info: ModelInfo) -> None:
        self.config = config
        self.endpoint = endpoint
        self.info = info
        self.model = f"{config.triton_model} @ {endpoint.url}"
        self.notice = remote_notice(info.served_model, endpoint.url)  # the page's banner for the tiny model
        generating = info.protocol == "generate"  # the prompt is ours to write, and our server reads the rest
        self.features = Features(
            stage_beam=generating or "reasoning" in info.inputs,
            history=generating or contract.HISTORY in info.inputs,
        )
        self.listeners = Listeners()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._closed = False
        self._loop = Loop("vlm-triton")
        self._transport: Transport | None = None  # made on the loop, at the first request

    # ---- start-up ----
    @classmethod
    def from_config(cls, config: Config, progress: Callable[[LoadProgress], None] | None = None) -> TritonBackend:
        """Connect, check server and model readiness, and read how the model wants to be called.

        A Triton that is not there yet (started alongside, or loading its model for minutes) is waited for,
        up to ``--triton-timeout``, with ``progress`` told why. Raises ``SystemExit`` with a message naming
        the URL and model when the remote is not usable.
        """
        endpoint = Endpoint.parse(config.triton_url)
        deadline = time.monotonic() + config.triton_timeout
        while True:
            try:
                info = inspect_model(endpoint, config.triton_model, config.triton_protocol, config.triton_timeout)
                break
            except TritonStarting as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(f"Cannot use Triton: {exc} (waited {config.triton_timeout:g} s)") from None
                if progress is not None:
                    progress(LoadProgress(f"waiting for Triton: {exc}"))
                time.sleep(min(1.0, left))
            except DemoError as exc:
                raise SystemExit(f"Cannot use Triton: {exc}") from None
        log.info(
            "Triton %s model %s: protocol=%s batched=%s decoupled=%s",
            endpoint.url,
            config.triton_model,
            info.protocol,
            info.batched,
            info.decoupled,
        )
        return cls(config, endpoint, info)

    # ---- Backend interface ----
    def submit(self, request: ValidRequest) -> TritonStream:
        """Prepare a request that passed the door (here, on the caller's thread) and send it (on the loop)."""
        if self._closed:
            raise EngineStoppedError("The Triton backend is shut down.")
        if not isinstance(request, ValidRequest):
            raise TypeError(f"the Triton backend takes a ValidRequest, not {type(request)}")
        if request.history and not self.features.history:
            raise UnsupportedError(
                f"The Triton model '{self.config.triton_model}' takes no {contract.HISTORY} input, so it cannot "
                "answer follow-up questions; start a new conversation."
            )
        send = self._prepare(request)
        with self._lock:
            if self._in_flight >= self.config.max_queue:
                raise QueueFullError(f"Server busy: {self._in_flight} requests already waiting. Try again shortly.")
            self._in_flight += 1
        stream = TritonStream(self._request_done)
        stream.set_abort(self._loop.run(self._run(stream, send)).cancel)
        return stream

    def run_batch(self, items: list[ValidRequest]) -> list[GenerationResult | DemoError]:
        """Send all items at once, so the remote's dynamic batcher can group them; errors stay in their slot."""
        return run_all(self.submit, items, self.config.triton_timeout + 5)

    def health(self) -> Health:
        """The remote's readiness (server and model), checked now with a short timeout."""
        remote = RemoteStatus(self.endpoint.url, self.config.triton_model, self.info.protocol)
        try:
            check_ready(self.endpoint, self.config.triton_model, min(2.0, self.config.triton_timeout))
        except DemoError as exc:
            return Health(False, self._in_flight, in_flight=self._in_flight, remote=remote, error=str(exc))
        remote = RemoteStatus(remote.url, remote.model, remote.protocol, server_ready=True, model_ready=True)
        return Health(True, self._in_flight, in_flight=self._in_flight, remote=remote)

    def add_listener(self, listener: Listener) -> None:
        self.listeners.add(listener)

    def pids(self) -> dict[str, int]:
        return {}  # the work happens in the remote server

    def close(self) -> None:
        self._closed = True
        self._loop.close(self._transport.close() if self._transport is not None else None)

    # ---- internals ----
    def _prepare(self, request: ValidRequest) -> Callable[[TritonStream, Transport], Any]:
        """What to send for ``request`` (its inputs made now), as a coroutine function of the stream and the
        transport; a request the model cannot take is refused here, at once."""
        model, info = self.config.triton_model, self.info
        if info.protocol == "generate":
            values = generate.values(info, request)
            if self.endpoint.scheme == "http":

                async def send_events(stream: TritonStream, transport: Transport) -> None:
                    async for event in transport.generate_stream(model, values):
                        generate.on_event(stream, event)

                return send_events
            named, wanted, read = generate.arrays(values), [], generate.on_piece
        else:
            named, wanted, read = infer.arrays(info, model, request), infer.outputs(info), infer.on_piece
            if not info.decoupled:

                async def send_once(stream: TritonStream, transport: Transport) -> None:
                    infer.finish(stream, await transport.infer(model, named, wanted), info, model)

                return send_once

        async def send_streaming(stream: TritonStream, transport: Transport) -> None:
            async for response in transport.stream(model, named, wanted):
                read(stream, response)

        return send_streaming

    async def _run(self, stream: TritonStream, send: Callable[[TritonStream, Transport], Any]) -> None:
        """One request on the loop, within the deadline; every failure reaches the stream as a typed error."""
        timeout = self.config.triton_timeout
        try:
            await asyncio.wait_for(send(stream, self._connected()), timeout)  # asyncio.timeout is 3.11's
            stream.finish(stream.remote_reason or "stop")  # no-op when the response already ended it
        except asyncio.CancelledError:
            stream.fail(RequestCancelledError("Request cancelled."))  # no-op after cancel(): it ended it
            raise
        except (TimeoutError, asyncio.TimeoutError):  # one class from 3.11 on
            if stream.fail(BackendTimeoutError(f"Triton did not finish the answer within {timeout:g} s.")):
                log.warning("Triton request timed out after %.1f s", timeout)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller as a typed error
            error = to_demo_error(exc, self.endpoint, self.config.triton_model, timeout)
            if stream.fail(error):
                log.info("Triton request failed: %s", error)

    def _connected(self) -> Transport:
        if self._transport is None:  # on the loop: one task at a time, no lock needed
            self._transport = connect(self.endpoint, self.config.triton_timeout, self.config.max_queue)
        return self._transport

    def _request_done(self, stream: Stream) -> None:
        with self._lock:
            self._in_flight -= 1
        self.listeners.on_request_done(stream)
