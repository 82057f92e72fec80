"""Forward requests to a remote Triton Inference Server, behind the same interface as the local engine.

Two contracts are spoken (``--triton-protocol auto`` picks one from the model's metadata):

* ``infer`` — the ensemble contract of the design documents: ``IMAGE`` UINT8 ``[H,W,3]`` (plus a batch
  dimension when the model batches) and ``QUESTION`` BYTES in, ``ANSWER`` BYTES out. Optional extra inputs
  (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``) and outputs (``FINISH_REASON``, ``PROMPT_TOKENS``,
  ``COMPLETION_TOKENS``, ``BATCH_SIZE``, ``QUEUE_S``, ``DECODE_S``, ``ERROR``) are used only when the model
  lists them, so any server with the bare contract works.
* ``generate`` — Triton's vLLM backend: ``text_input`` (chat-templated prompt), ``image`` (base64 of an image
  file), ``stream``, ``sampling_parameters`` (JSON), ``exclude_input_in_output`` → ``text_output``, streamed
  over gRPC (decoupled) or HTTP ``/generate_stream`` (server-sent events); the ``return_*`` flags the model
  lists are set, so the final response carries the counts (and, from our server, how the engine ran it).

The status line reports what the remote engine measured (batch size, tokens, decoding time); what a remote
does not report is left out rather than guessed from this side's clock. A model whose config names the tiny
model (``parameters { key: "model" ... }``) gets the tiny model's banner.

Every call runs in its own thread and hands text to the caller through a thread-safe queue; a deadline
timer fails the request with :class:`BackendTimeoutError` and aborts the remote call, so nothing waits
longer than ``--triton-timeout`` whatever the transport does.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import numpy as np

from vlm_demo.backends.base import Features, Health, RemoteStatus
from vlm_demo.config import Config
from vlm_demo.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    DemoError,
    EngineStoppedError,
    GenerationError,
    QueueFullError,
    RequestCancelledError,
    UnsupportedError,
)
from vlm_demo.models.choice import remote_notice
from vlm_demo.prompt import Turn
from vlm_demo.request import STAGE_BEAM, ClientSlots, SamplingParams, ValidRequest
from vlm_demo.results import GenerationResult, LoadProgress
from vlm_demo.stream import Listener, OutputStream, run_all
from vlm_demo.triton import contract
from vlm_demo.triton.contract import chat_prompt, error_from_text

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """A parsed ``--triton-url``: ``http://host:port`` or ``grpc://host:port``."""

    scheme: str  # "http" or "grpc"
    address: str  # host:port, as tritonclient wants it

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parsed = urlparse(url if "://" in url else "http://" + url)
        if parsed.scheme not in {"http", "grpc"} or not parsed.hostname:
            raise SystemExit(f"--triton-url must look like http://host:port or grpc://host:port, got {url!r}")
        port = parsed.port or (8001 if parsed.scheme == "grpc" else 8000)
        return cls(parsed.scheme, f"{parsed.hostname}:{port}")

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"


# ---- turning transport failures into the demo's typed errors ------------------------------------------


def _status_name(exc: Exception) -> str:
    status = exc.status() if callable(getattr(exc, "status", None)) else None
    return str(status or "")


class TritonStarting(BackendUnavailableError):
    """Triton is not there yet: nothing listens at the address, the server is still starting, or the model is
    still loading. At start-up the demo waits for it (up to ``--triton-timeout``); later it is an error."""


def to_demo_error(exc: BaseException, endpoint: Endpoint, model: str, timeout: float) -> DemoError:
    """A specific, user-facing error for anything a Triton call can raise."""
    if isinstance(exc, DemoError):
        return exc
    text = str(exc) or exc.__class__.__name__
    typed = error_from_text(text)
    if typed is not None:
        return typed
    status = _status_name(exc) if isinstance(exc, Exception) else ""
    if isinstance(exc, (TimeoutError, socket.timeout)) or "DEADLINE_EXCEEDED" in status or "timed out" in text.lower():
        return BackendTimeoutError(f"Triton at {endpoint.url} did not answer within {timeout:g} s.")
    if isinstance(exc, ConnectionError) or "UNAVAILABLE" in status or _is_requests_connection_error(exc):
        return TritonStarting(f"Triton at {endpoint.url} is unreachable ({_short(text)}). Is the server running?")
    lowered = text.lower()
    if any(word in lowered for word in ("unknown model", "not found", "not ready", "unavailable", "is stopping")):
        return BackendUnavailableError(f"Triton model '{model}' is not available at {endpoint.url}: {_short(text)}")
    return GenerationError(f"Triton model '{model}' failed: {_short(text)}")


def _is_requests_connection_error(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.Timeout)


def _short(text: str) -> str:
    """Triton wraps Python-backend errors in a traceback; its last non-empty line says what happened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else text)[:300]


# ---- one remote request ----------------------------------------------------------------------------------


class TritonStream(OutputStream):
    """A request in flight to Triton: the engine ``Request``'s handle, fed by a transport thread.

    On top of :class:`OutputStream` it keeps a deadline timer and a way to abort the remote call
    (gRPC cancel / stream stop, or closing the SSE response) on cancel or timeout.
    """

    def __init__(self, timeout: float, on_done: Callable[[TritonStream], None]) -> None:
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
        self._timeout = timeout
        self._abort: Callable[[], None] | None = None
        self.add_done_callback(on_done)
        self._timer = threading.Timer(timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        """Stop waiting and stop the remote work."""
        if self.fail(RequestCancelledError("Request cancelled.")):
            self._run_abort()

    # ---- transport side ----
    def set_abort(self, abort: Callable[[], None]) -> None:
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

    def _end(self, result: GenerationResult | None, error: DemoError | None) -> bool:
        self._timer.cancel()
        return super()._end(result, error)

    def _expire(self) -> None:
        if self.fail(BackendTimeoutError(f"Triton did not finish the answer within {self._timeout:g} s.")):
            log.warning("Triton request timed out after %.1f s", self._timeout)
            self._run_abort()

    def _run_abort(self) -> None:
        with self._lock:
            abort, self._abort = self._abort, None
        if abort is not None:
            try:
                abort()
            except Exception:
                log.debug("aborting a Triton call failed", exc_info=True)


# ---- the backend ---------------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """What the model's metadata (and config, when readable) says about how to call it."""

    protocol: str  # "infer" or "generate"
    inputs: dict[str, list[int]]  # name -> shape as the metadata reports it
    outputs: list[str]
    batched: bool  # IMAGE carries a leading batch dimension (max_batch_size > 0)
    decoupled: bool
    served_model: str | None = None  # what the config's "model" parameter says the engine runs, if it says


class TritonBackend:
    """The demo's backend when ``--triton-url`` is set: every request goes to a remote Triton model."""

    name = "triton"
    remote = True

    def __init__(self, config: Config, endpoint: Endpoint, info: ModelInfo) -> None:
        self.config = config
        self.endpoint = endpoint
        self.info = info
        self.model = f"{config.triton_model} @ {endpoint.url}"
        self.notice = remote_notice(info.served_model, endpoint.url)  # the page's banner for the tiny model
        generate = info.protocol == "generate"  # the prompt is ours to write, and our server reads the rest
        self.features = Features(
            stage_beam=generate or "reasoning" in info.inputs, history=generate or contract.HISTORY in info.inputs
        )
        self._listeners: list[Listener] = []
        self._in_flight = 0
        self.clients = ClientSlots(config.max_per_client)
        self._lock = threading.Lock()
        self._closed = False

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
        """Send a request that passed the door, in a background thread."""
        if self._closed:
            raise EngineStoppedError("The Triton backend is shut down.")
        if not isinstance(request, ValidRequest):
            raise TypeError(f"the Triton backend takes a ValidRequest, not {type(request)}")
        image, question, params = request.image, request.question, request.params
        client = request.client
        if request.history and not self.features.history:
            raise UnsupportedError(
                f"The Triton model '{self.config.triton_model}' takes no {contract.HISTORY} input, so it cannot "
                "answer follow-up questions; start a new conversation."
            )
        with self._lock:
            if self._in_flight >= self.config.max_queue:
                raise QueueFullError(f"Server busy: {self._in_flight} requests already waiting. Try again shortly.")
            self.clients.take(client)  # Triton orders the requests; the cap is ours
            self._in_flight += 1
        stream = TritonStream(self.config.triton_timeout, lambda done: self._request_done(done, client))
        target = self._run_generate if self.info.protocol == "generate" else self._run_infer
        args = (target, stream, image, question, params, request.history)
        threading.Thread(target=self._guarded, args=args, daemon=True).start()
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
        self._listeners.append(listener)

    def pids(self) -> dict[str, int]:
        return {}  # the work happens in the remote server

    def close(self) -> None:
        self._closed = True

    # ---- internals ----
    def _request_done(self, stream: TritonStream, client: str) -> None:
        self.clients.give_back(client)
        with self._lock:
            self._in_flight -= 1
        for listener in self._listeners:
            try:
                listener.on_request_done(stream)
            except Exception:  # a broken metric must not break serving
                log.exception("listener %r failed", listener)

    def _guarded(self, target: Callable, stream: TritonStream, *args: Any) -> None:
        try:
            target(stream, *args)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller as a typed error
            error = to_demo_error(exc, self.endpoint, self.config.triton_model, self.config.triton_timeout)
            if not isinstance(error, BackendTimeoutError) or not stream.done:
                log.info("Triton request failed: %s", error)
            stream.fail(error)

    # -- infer contract --
    def _infer_inputs(
        self, mod: Any, image: Any, question: str, params: SamplingParams, history: tuple[Turn, ...]
    ) -> list[Any]:
        lead = [1] if self.info.batched else []
        pixels = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
        arrays = {
            contract.IMAGE: pixels.reshape(lead + list(pixels.shape)),
            contract.QUESTION: np.array([question.encode("utf-8")], dtype=np.object_).reshape(lead + [1]),
        }
        if history:  # only a follow-up sends it: a model without the input still takes every first question
            text = json.dumps([list(turn) for turn in history], ensure_ascii=False)
            arrays[contract.HISTORY] = np.array([text.encode("utf-8")], dtype=np.object_).reshape(lead + [1])
        values = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": 0 if params.greedy or params.seed is None else params.seed,  # greedy: one cache key
            "reasoning": params.reasoning.encode("utf-8"),
            "beams": params.beams,
        }
        extras = {name: np.array([values[name]], dtype=kind) for name, (kind, _) in contract.SAMPLING_INPUTS.items()}
        if params.reasoning == STAGE_BEAM and "reasoning" not in self.info.inputs:
            raise UnsupportedError(
                f"The Triton model '{self.config.triton_model}' has no 'reasoning' input, so it cannot think harder "
                "(stage beam search); ask in the normal mode."
            )
        for name, value in extras.items():
            if name in self.info.inputs:
                arrays[name] = value.reshape(lead + [1])
        return [_infer_input(mod, name, array) for name, array in arrays.items()]

    def _run_infer(
        self, stream: TritonStream, image: Any, question: str, params: SamplingParams, history: tuple[Turn, ...]
    ) -> None:
        wanted = [n for n in contract.INFER_OUTPUTS if n in self.info.outputs]
        timeout = self.config.triton_timeout
        if self.endpoint.scheme == "http":
            import tritonclient.http as mod

            client = mod.InferenceServerClient(
                self.endpoint.address, connection_timeout=timeout, network_timeout=timeout
            )
            try:
                inputs = self._infer_inputs(mod, image, question, params, history)
                outputs = [mod.InferRequestedOutput(n, binary_data=True) for n in wanted]
                response = client.infer(self.config.triton_model, inputs, outputs=outputs)
            finally:
                client.close()
            self._finish_infer(stream, response)
            return
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(self.endpoint.address)
        inputs = self._infer_inputs(mod, image, question, params, history)
        outputs = [mod.InferRequestedOutput(n) for n in wanted]
        if self.info.decoupled:
            self._grpc_stream(stream, client, inputs, outputs, self._on_infer_chunk)
            return
        done = threading.Event()

        def callback(result: Any, error: Any) -> None:
            try:
                if error is not None:
                    stream.fail(to_demo_error(error, self.endpoint, self.config.triton_model, timeout))
                else:
                    self._finish_infer(stream, result)
            except BaseException as exc:  # noqa: BLE001
                stream.fail(to_demo_error(exc, self.endpoint, self.config.triton_model, timeout))
            finally:
                done.set()

        try:
            call = client.async_infer(
                self.config.triton_model, inputs, callback, outputs=outputs, client_timeout=timeout
            )
            stream.set_abort(call.cancel)
            done.wait(timeout + 1)
        finally:
            client.close()

    def _on_infer_chunk(self, stream: TritonStream, result: Any) -> None:
        """One response of a decoupled infer-contract model: ANSWER holds the next piece of text."""
        answer = result.as_numpy(contract.ANSWER)
        if answer is not None and answer.size:
            stream.push(_text(answer))
        read_counts(stream, result)

    def _finish_infer(self, stream: TritonStream, result: Any) -> None:
        error = result.as_numpy(contract.ERROR) if contract.ERROR in self.info.outputs else None
        if error is not None and error.size and _text(error):
            message = _text(error)
            stream.fail(error_from_text(message) or GenerationError(f"Triton model failed: {message}"))
            return
        answer = result.as_numpy(contract.ANSWER)
        if answer is None:
            raise GenerationError(f"Triton model '{self.config.triton_model}' returned no ANSWER.")
        read_counts(stream, result)
        stream.push(_text(answer))
        reason = result.as_numpy("FINISH_REASON")
        stream.finish(_text(reason) if reason is not None and reason.size else "stop")

    # -- generate contract --
    def _sampling_json(self, params: SamplingParams) -> str:
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
        }
        if params.seed is not None and not params.greedy:
            sampling["seed"] = params.seed
        if params.ignore_eos:
            sampling["ignore_eos"] = True
        if params.reasoning == STAGE_BEAM:  # only then: a stock vLLM model would refuse the unknown keys
            sampling["reasoning"] = params.reasoning
            sampling["beams"] = params.beams
        return json.dumps(sampling)

    def _run_generate(
        self, stream: TritonStream, image: Any, question: str, params: SamplingParams, history: tuple[Turn, ...]
    ) -> None:
        values: dict[str, Any] = {
            contract.TEXT_INPUT: chat_prompt(question, history),
            contract.IMAGE_INPUT: encode_image(image),
            "stream": True,
            contract.SAMPLING_PARAMETERS: self._sampling_json(params),
            "exclude_input_in_output": True,
        }
        for flag in contract.GENERATE_FLAGS[2:]:  # the return_* flags
            if flag in self.info.inputs:
                values[flag] = True
        if self.endpoint.scheme == "http":
            self._generate_sse(stream, values)
            return
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(self.endpoint.address)
        inputs = []
        for name, value in values.items():
            if name not in self.info.inputs:
                continue
            if isinstance(value, bool):
                array = np.array([value], dtype=bool)
            else:
                array = np.array([value.encode("utf-8")], dtype=np.object_)
            inputs.append(_infer_input(mod, name, array))
        self._grpc_stream(stream, client, inputs, None, self._on_generate_chunk)

    def _on_generate_chunk(self, stream: TritonStream, result: Any) -> None:
        text = result.as_numpy(contract.TEXT_OUTPUT)
        if text is not None and text.size:
            stream.push(_text(text))
        read_counts(stream, result)

    def _generate_sse(self, stream: TritonStream, values: dict[str, Any]) -> None:
        """POST to ``/generate_stream`` and read server-sent events; an error may arrive mid-stream (HTTP 200)."""
        import requests

        url = f"http://{self.endpoint.address}/v2/models/{self.config.triton_model}/generate_stream"
        body = {k: v for k, v in values.items() if k in self.info.inputs}
        timeout = self.config.triton_timeout
        response = requests.post(url, json=body, stream=True, timeout=(min(timeout, 10.0), timeout))
        stream.set_abort(response.close)
        with response:
            if response.status_code != 200:
                message = _http_error(response)
                raise error_from_text(message) or GenerationError(message)
            for line in response.iter_lines(decode_unicode=True):
                if stream.done:
                    return
                if not line or not line.startswith("data:"):
                    continue
                event = json.loads(line[5:].strip())
                if "error" in event:
                    message = str(event["error"])
                    raise error_from_text(message) or GenerationError(f"Triton model failed: {_short(message)}")
                stream.push(_event_text(event.get(contract.TEXT_OUTPUT, "")))
                read_event_counts(stream, event)
        stream.finish(stream.remote_reason or "stop")

    # -- gRPC streaming (decoupled models, both contracts) --
    def _grpc_stream(
        self,
        stream: TritonStream,
        client: Any,
        inputs: list[Any],
        outputs: list[Any] | None,
        on_chunk: Callable[[TritonStream, Any], None],
    ) -> None:
        finished = threading.Event()
        timeout = self.config.triton_timeout

        def callback(result: Any, error: Any) -> None:
            try:
                if error is not None:
                    stream.fail(to_demo_error(error, self.endpoint, self.config.triton_model, timeout))
                    finished.set()
                    return
                on_chunk(stream, result)
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    stream.finish(stream.remote_reason or "stop")
                    finished.set()
            except BaseException as exc:  # noqa: BLE001
                stream.fail(to_demo_error(exc, self.endpoint, self.config.triton_model, timeout))
                finished.set()

        def stop() -> None:
            client.stop_stream(cancel_requests=True)

        try:
            client.start_stream(callback, stream_timeout=timeout)
            stream.set_abort(stop)
            client.async_stream_infer(
                self.config.triton_model, inputs, outputs=outputs, enable_empty_final_response=True
            )
            finished.wait(timeout + 1)
        finally:
            if not stream.done:
                stream.fail(BackendTimeoutError(f"Triton did not finish the answer within {timeout:g} s."))
            client.close()


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
    if reason is not None and reason.size and _text(reason):
        stream.remote_reason = _finish_reason(_text(reason))


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


def _text(array: np.ndarray) -> str:
    """A BYTES tensor (any shape) as one string."""
    return "".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in np.ravel(array))


def _event_text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return str(value)


def _http_error(response: Any) -> str:
    """The error text of a failed generate call: a JSON body, or an SSE ``data:`` event holding one."""
    body = response.text
    for candidate in (body, *(line[5:] for line in body.splitlines() if line.startswith("data:"))):
        try:
            return str(json.loads(candidate).get("error", candidate))
        except (ValueError, AttributeError):
            continue
    return f"HTTP {response.status_code}: {body[:300]}"


def _infer_input(mod: Any, name: str, array: np.ndarray) -> Any:
    from tritonclient.utils import np_to_triton_dtype

    item = mod.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    if mod.__name__.endswith("http"):
        item.set_data_from_numpy(array, binary_data=True)
    else:
        item.set_data_from_numpy(array)
    return item


def encode_image(image: Any) -> str:
    """Base64 of a PNG file: lossless, so the remote sees exactly the pixels the local engine would."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ---- readiness and metadata --------------------------------------------------------------------------


def _admin_client(endpoint: Endpoint, timeout: float) -> Any:
    if endpoint.scheme == "http":
        import tritonclient.http as mod

        return mod.InferenceServerClient(endpoint.address, connection_timeout=timeout, network_timeout=timeout)
    import tritonclient.grpc as mod

    return mod.InferenceServerClient(endpoint.address)


def check_ready(endpoint: Endpoint, model: str, timeout: float) -> dict[str, Any]:
    """Raise a typed error saying which of server or model is not ready, or that no Triton answered at all."""
    client = _admin_client(endpoint, timeout)
    kwargs = {} if endpoint.scheme == "http" else {"client_timeout": timeout}
    try:
        try:
            live = client.is_server_live(**kwargs)
            server_ready = client.is_server_ready(**kwargs)
        except Exception as exc:
            error = to_demo_error(exc, endpoint, model, timeout)
            if isinstance(error, GenerationError):  # an odd answer to a health check: something else is there
                error = BackendUnavailableError(
                    f"Triton at {endpoint.url} is unreachable or not a Triton server ({_short(str(exc))})."
                )
            raise error from None
        if not live or not server_ready:
            raise not_ready_error(endpoint, "live" if not live else "ready", timeout)
        try:
            model_ready = client.is_model_ready(model, **kwargs)
        except Exception as exc:
            raise to_demo_error(exc, endpoint, model, timeout) from None
        if not model_ready:
            raise _model_not_ready(client, kwargs, endpoint, model)
        return {"server_ready": True, "model_ready": True}
    finally:
        client.close()


def _model_not_ready(client: Any, kwargs: dict[str, Any], endpoint: Endpoint, model: str) -> DemoError:
    """Why a ready server's model is not. Only a model the repository index says failed to load is final;
    one it does not list yet (a server still binding its models) or that is loading is worth waiting for,
    and so is any model where the index is closed (PyTriton restricts it)."""
    try:
        index = client.get_model_repository_index(**({"as_json": True} if kwargs else {}))
    except Exception:  # noqa: BLE001 - an index some servers restrict: the plain answer then
        index = None
    entries = index.get("models", []) if isinstance(index, dict) else index
    if not isinstance(entries, list):
        return TritonStarting(
            f"Triton at {endpoint.url} is ready but model '{model}' is not (unknown, still loading or failed to load)."
        )
    states = {entry.get("name"): entry for entry in entries if isinstance(entry, dict)}
    entry = states.get(model)
    if entry is None:
        served = ", ".join(sorted(str(name) for name in states)) or "none yet"
        return TritonStarting(f"Triton at {endpoint.url} has no model '{model}' (it serves: {served}).")
    state = str(entry.get("state", "")).upper()
    if state in ("LOADING", "READY", ""):
        return TritonStarting(f"Triton at {endpoint.url} is still loading model '{model}'.")
    reason = entry.get("reason") or state.lower()
    return BackendUnavailableError(f"Triton at {endpoint.url} could not load model '{model}': {_short(str(reason))}")


def not_ready_error(endpoint: Endpoint, check: str, timeout: float) -> DemoError:
    """Why a health check said no: only Triton's own "no" (HTTP 400, or gRPC) means "up but not ready".

    Over HTTP the client only reports "not 200". Whatever else answers at the address (a gateway's 504
    after its own timeout, a 404 from some other server, an intercepting proxy) means no Triton was
    reached, and "up but not ready" would send the user looking at the wrong thing.
    """
    if endpoint.scheme == "http":
        import requests

        url = f"http://{endpoint.address}/v2/health/{check}"
        with requests.Session() as session:
            session.trust_env = False  # ask the address itself, as the Triton client does (it ignores *_PROXY)
            try:
                status = session.get(url, timeout=timeout).status_code
            except requests.Timeout:
                return BackendTimeoutError(f"Triton at {endpoint.url} did not answer within {timeout:g} s.")
            except requests.RequestException as exc:
                return BackendUnavailableError(f"Triton at {endpoint.url} is unreachable ({_short(str(exc))}).")
        if status in (408, 504):
            return BackendTimeoutError(
                f"Triton at {endpoint.url} did not answer within {timeout:g} s (a gateway answered HTTP {status})."
            )
        if status not in (200, 400):
            return BackendUnavailableError(
                f"Triton at {endpoint.url} is unreachable: /v2/health/{check} answered HTTP {status}, which is "
                "not a Triton server's answer. Is the address right and the server running?"
            )
    return TritonStarting(
        f"Triton at {endpoint.url} is up but not ready (health/{check} says no: still starting or stopping?)."
    )


def inspect_model(endpoint: Endpoint, model: str, protocol: str, timeout: float) -> ModelInfo:
    """Check readiness and read the model's metadata to decide how to call it."""
    check_ready(endpoint, model, min(timeout, 10.0))
    client = _admin_client(endpoint, timeout)
    kwargs: dict[str, Any] = {} if endpoint.scheme == "http" else {"as_json": True, "client_timeout": timeout}
    try:
        try:
            meta = client.get_model_metadata(model, **kwargs)
        except Exception as exc:
            raise to_demo_error(exc, endpoint, model, timeout) from None
        try:
            config = client.get_model_config(model, **kwargs)
            config = config.get("config", config)
        except Exception:  # some servers restrict the config endpoint; metadata is enough
            config = {}
    finally:
        client.close()
    inputs = {i["name"]: [int(d) for d in i.get("shape", [])] for i in meta.get("inputs", [])}
    outputs = [o["name"] for o in meta.get("outputs", [])]
    if protocol == "auto":
        if contract.IMAGE in inputs and contract.QUESTION in inputs:
            protocol = "infer"
        elif contract.TEXT_INPUT in inputs:
            protocol = "generate"
        else:
            raise BackendUnavailableError(
                f"Triton model '{model}' speaks neither contract: inputs {sorted(inputs)} "
                "(expected IMAGE+QUESTION, or text_input). Set --triton-protocol if this is wrong."
            )
    needed = {"infer": (contract.IMAGE, contract.QUESTION), "generate": (contract.TEXT_INPUT,)}[protocol]
    missing = [n for n in needed if n not in inputs]
    if missing:
        raise BackendUnavailableError(
            f"Triton model '{model}' lacks input(s) {missing} needed by --triton-protocol {protocol}."
        )
    if protocol == "infer" and contract.ANSWER not in outputs:
        raise BackendUnavailableError(f"Triton model '{model}' has no ANSWER output (outputs: {outputs}).")
    policy = config.get("model_transaction_policy", {}) if isinstance(config, dict) else {}
    decoupled = bool(policy.get("decoupled", protocol == "generate" and not config))
    if decoupled and protocol == "infer" and endpoint.scheme == "http":
        raise BackendUnavailableError(
            f"Triton model '{model}' is decoupled (streaming); Triton streams it only over gRPC: use --triton-url grpc://..."
        )
    batched = protocol == "infer" and len(inputs[contract.IMAGE]) == 4
    return ModelInfo(protocol, inputs, outputs, batched, decoupled, _parameter(config, contract.MODEL_PARAMETER))


def _parameter(config: Any, name: str) -> str | None:
    """A model-config parameter's string value, as both transports' JSON config gives it; ``None`` if absent."""
    parameters = config.get("parameters") if isinstance(config, dict) else None
    value = parameters.get(name) if isinstance(parameters, dict) else None
    return value.get("string_value") if isinstance(value, dict) else None
