"""What the page's events do: the door, the streaming ``/ask``, ``/ask_batch``, Stop; no layout, no model,
no rendering (that is :mod:`~vlm_demo.web.render`'s).

- ``/ask`` streams. It is an *async* generator: it polls its request's stream on the event loop and
  sends the visitor whatever arrived since the last update, so there is no thread per visitor and
  no thread hop per update; the end of an answer wakes it at once. Each update parses the answer
  once; the update interval grows with the number of live answers so the web process spends a
  bounded share of a core on page updates however many visitors stream. Outputs are plain strings
  sent without Gradio's postprocessing (the events set ``postprocess=False``): Gradio sends each
  output as a diff against the previous update, so an unchanged output costs nothing on the wire.
  ``gr.skip()`` is avoided on purpose: Gradio 6.31 rebuilds the whole component for every skipped
  output of every update, which measured as twice the web process's CPU per answer.
- ``/ask_batch`` is Gradio's batch mode (``batch=True``). Every item of a Gradio batch is submitted
  to the backend at once and the handler only waits for the results, so items join the engine's
  running batch as soon as Gradio hands them over, and several Gradio batches can be in flight.
  A bad item gets its error text in its own outputs (raising would fail every user in the batch).

Both take :data:`~vlm_demo.web.contract.INPUTS` (the last two optional: ``"normal"`` and 2) and return
:class:`~vlm_demo.web.contract.Outputs`, plain strings. With
``reasoning="stage-beam"`` (the page's "Think harder") the running stage's panel shows its candidates
as they are written and judged, then the winner; ``beams_html`` lists every stage's candidates with the
winner marked and the judge's words.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from vlm_demo.backends.base import Backend, Stream
from vlm_demo.config import Config
from vlm_demo.errors import DemoError, GenerationError, RequestCancelledError
from vlm_demo.images import load_image
from vlm_demo.schema import (
    DEFAULT_BEAMS,
    NORMAL,
    GenerationResult,
    Limits,
    ValidRequest,
    has_image,
    params_from_inputs,
    validate_request,
)
from vlm_demo.web.contract import Outputs
from vlm_demo.web.conversation import Conversation
from vlm_demo.web.metrics import Metrics
from vlm_demo.web.render import (
    ERROR_TITLES,
    error_status,
    for_visitor,
    progress,
    render,
    retry_helps,
    searched_beams,
)

log = logging.getLogger(__name__)

UPDATE_INTERVAL_S = 0.05  # at most ~20 page updates a second per answer; humans see no faster
UPDATES_PER_S_BUDGET = 400.0  # page updates a second over all live answers: about a third of a core at ~0.8 ms each
MAX_UPDATE_INTERVAL_S = 1.0  # however many answers stream, each visitor sees its text move every second
TOKEN_TIMEOUT_S = 300.0  # longest silence tolerated from the backend before giving up on a request


class Sessions:
    """Which streams each visitor has running, so Stop cancels only that visitor's runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, set[Stream]] = defaultdict(set)

    def add(self, session: str, stream: Stream) -> None:
        with self._lock:
            self._streams[session].add(stream)

    def discard(self, session: str, stream: Stream) -> None:
        with self._lock:
            streams = self._streams.get(session)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._streams[session]

    def cancel(self, session: str) -> int:
        with self._lock:
            streams = list(self._streams.pop(session, ()))
        for stream in streams:
            stream.cancel()
        return len(streams)

    @property
    def live(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._streams.values())


@dataclasses.dataclass
class Seen:
    """What one answer has produced so far, for the page's handler around the stream: the text, the result."""

    raw: str = ""
    result: GenerationResult | None = None


class Changes:
    """Suppresses an update that would change nothing on the page (e.g. a poll with no new text)."""

    def __init__(self) -> None:
        self._shown: Outputs | None = None

    def __call__(self, values: Outputs) -> Outputs | None:
        """The update to send, or ``None`` when nothing changed."""
        if values == self._shown:
            return None
        self._shown = values
        return values


def wake(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set an asyncio event from the backend's thread (a no-op once the page's loop has closed)."""
    try:
        loop.call_soon_threadsafe(event.set)
    except RuntimeError:
        pass


def client_of(request: gr.Request | None) -> str:
    """Who asks, for fair share and the per-client cap: the caller's address as uvicorn reports it (the
    visitor's own when a trusted proxy said so in X-Forwarded-For), else the browser session: a loopback
    address is this machine (a share-link tunnel, a local proxy, the owner), not one visitor."""
    if request is None:
        return ""
    address = request.client.host if request.client is not None else ""
    if address and not _loopback(address):
        return address
    return f"session:{request.session_hash}" if request.session_hash else address


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # not an IP (a test client's name)
        return False


def gr_error(error: DemoError) -> gr.Error:
    expected = error.code != GenerationError.code  # the rest are logged where they happen, or are the visitor's
    return gr.Error(str(error), title=ERROR_TITLES.get(error.code, "Error"), print_exception=not expected)


class Handlers:
    """The page's event handlers, bound to one backend."""

    def __init__(self, backend: Backend, config: Config, metrics: Metrics) -> None:
        self.backend = backend
        self.config = config
        self.limits = Limits.from_config(config)
        self.metrics = metrics
        self.sessions = Sessions()

    # ---- the door -------------------------------------------------------------------------------
    def admit(
        self,
        image: Any,
        question: Any,
        max_new_tokens: Any,
        temperature: Any,
        top_p: Any,
        reasoning: Any = None,
        beams: Any = None,
        history: Any = None,
    ) -> ValidRequest:
        """The shared door (:mod:`vlm_demo.schema`) with the page's loose inputs."""
        params = params_from_inputs(max_new_tokens, temperature, top_p, self.limits, reasoning, beams)
        return validate_request(image, question, params, self.limits, history)

    def update_interval(self) -> float:
        """Seconds between one visitor's page updates: 50 ms, longer when many answers stream at once."""
        return min(MAX_UPDATE_INTERVAL_S, max(UPDATE_INTERVAL_S, self.sessions.live / UPDATES_PER_S_BUDGET))

    def check_upload(self, image: Any) -> str:
        """The page validates an upload as soon as it is chosen: an error message for it, or ""."""
        if not has_image(image):
            return ""
        try:
            load_image(image, max_pixels=self.limits.max_image_pixels, max_bytes=self.limits.max_image_bytes)
        except DemoError as err:
            return str(err)
        return ""

    # ---- /ask: one streaming request --------------------------------------------------------------
    async def ask(
        self,
        image: Any,
        question: Any,
        max_new_tokens: Any,
        temperature: Any,
        top_p: Any,
        reasoning: Any = NORMAL,
        beams: Any = DEFAULT_BEAMS,
        request: gr.Request = None,  # type: ignore[assignment]  # Gradio injects it
    ) -> AsyncIterator[Outputs]:
        """Stream the four stages of one answer as tokens arrive; bad input raises an error naming the problem."""
        inputs = (image, question, max_new_tokens, temperature, top_p, reasoning, beams)
        async with contextlib.aclosing(self._ask(inputs, request)) as updates:
            async for update in updates:
                yield update

    async def ask_page(
        self,
        image: Any,
        question: Any,
        max_new_tokens: Any,
        temperature: Any,
        top_p: Any,
        reasoning: Any = NORMAL,
        beams: Any = DEFAULT_BEAMS,
        conversation: Any = None,
        request: gr.Request = None,  # type: ignore[assignment]
    ) -> AsyncIterator[tuple[Any, ...]]:
        """The page's Ask: like ``ask``, but a failure is shown once, in the status line, over cleared panels
        (what was already streamed stays), instead of an error toast and a red mark on every output.

        A follow-up: the ``conversation``'s earlier turns go with the question, and every update also
        carries the conversation as it stands (a finished answer becomes its newest turn)."""
        talk = Conversation.of(conversation)
        seen = Seen()
        asked = talk.unfinished(question if isinstance(question, str) else "")
        inputs = (image, question, max_new_tokens, temperature, top_p, reasoning, beams, talk.history())
        sent = None  # the conversation the page holds: sent again only when it changes (a State output set
        # on every update would cost Gradio a component config rebuild each time; gr.skip() costs nothing)
        try:  # aclosing: when Gradio closes this generator (Clear, a closed tab) the inner one ends too
            async with contextlib.aclosing(self._ask(inputs, request, seen)) as updates:
                async for update in updates:
                    if seen.result is not None and seen.result.finish_reason in ("stop", "length"):
                        asked = talk.finished(asked.asked.strip(), seen.result.text)
                    yield (*update, gr.skip() if asked is sent else asked)
                    sent = asked
        except gr.Error as err:
            if not retry_helps(err.title):  # the input must change first: nothing for Retry to ask again
                asked = talk.unfinished("")
            yield (*render(seen.raw, f"⚠ {err.title}: {err.message}", final=True, ended="error"), asked)

    async def _ask(
        self, inputs: tuple[Any, ...], request: gr.Request | None, seen: Seen | None = None
    ) -> AsyncIterator[Outputs]:
        loop = asyncio.get_running_loop()
        try:  # decoding an upload takes up to ~0.1 s: not on the event loop that serves everyone
            stream, beams = await loop.run_in_executor(None, self._submit, client_of(request), *inputs)
        except DemoError as err:
            self.metrics.rejected(err.code)
            raise gr_error(self.for_visitor(err)) from None
        session = (request.session_hash if request is not None else None) or f"anonymous-{id(stream)}"
        self.sessions.add(session, stream)
        finished = asyncio.Event()
        stream.add_done_callback(lambda _: wake(loop, finished))
        started = last = time.monotonic()
        changes = Changes()
        raw = ""
        view = None
        second = -1  # the counter's whole seconds last shown
        try:
            while True:
                text, ended = stream.drain()
                now = time.monotonic()
                if text:
                    raw += text
                    last = now
                    if seen is not None:
                        seen.raw = raw
                searching, view = view, stream.beam_view()
                if view is not None and view != searching:
                    last = now  # candidates are being written or judged: the model is not silent
                # New text, a queue position that may have moved, a search, or the counter's next second.
                if text or not raw or view is not None or int(now - started) != second:
                    second = int(now - started)
                    update = changes(
                        progress(raw, view, None if raw else stream.ahead(), now - started, stream.tokens())
                    )
                    if update is not None:
                        yield update
                if ended:
                    break
                if now - last > TOKEN_TIMEOUT_S:
                    raise TimeoutError
                if not stream.done:
                    try:
                        await asyncio.wait_for(finished.wait(), self.update_interval())
                    except asyncio.TimeoutError:
                        pass
            result = stream.result(timeout=TOKEN_TIMEOUT_S)
        except RequestCancelledError:
            yield render(
                raw, f"Stopped after {time.monotonic() - started:.1f} s.", final=True, view=view, ended="cancelled"
            )
            return
        except TimeoutError:
            stream.cancel()
            raise gr.Error(f"The model sent nothing for {TOKEN_TIMEOUT_S:.0f} s; please try again.") from None
        except DemoError as err:  # failed mid-answer: what was streamed stays in the panels
            raise gr_error(self.for_visitor(err)) from None
        finally:
            self.sessions.discard(session, stream)
            stream.cancel()  # no-op when finished; frees the model row if the visitor went away
        if seen is not None:
            seen.result = result
        yield render(result.text, final=True, result=result, view=result.beam or stream.beam_view(), beams=beams)

    def _submit(self, client: str, *inputs: Any) -> tuple[Stream, int]:
        """The request's stream, and its candidates per stage (0: not a stage-beam search) for the status line."""
        valid = dataclasses.replace(self.admit(*inputs), client=client)
        return self.backend.submit(valid), searched_beams(valid.params)

    def for_visitor(self, error: DemoError) -> DemoError:
        """The error in a visitor's words (a remote model server's transport details go to the log instead)."""
        shown = for_visitor(error, self.backend.remote)
        if shown is not error:
            log.warning("%s: %s (the visitor reads: %s)", self.backend.name, error, shown)
        return shown

    def stop(self, request: gr.Request = None) -> None:  # type: ignore[assignment]
        """Cancel this visitor's running answers only; other visitors' requests keep going."""
        session = request.session_hash if request is not None else None
        count = self.sessions.cancel(session) if session else 0
        log.info("stop from session %s cancelled %d run(s)", session, count)

    def forget_session(self, request: gr.Request = None) -> None:  # type: ignore[assignment]
        """The tab was closed: free the model rows its runs were using."""
        if request is not None and request.session_hash:
            self.sessions.cancel(request.session_hash)

    # ---- /ask_batch: Gradio batch mode ------------------------------------------------------------
    def ask_batch(
        self,
        image: list[Any],
        question: list[Any],
        max_new_tokens: list[Any],
        temperature: list[Any],
        top_p: list[Any],
        reasoning: list[Any] | None = None,
        beams: list[Any] | None = None,
        request: gr.Request = None,  # type: ignore[assignment]  # the batch's first caller (Gradio's rule)
    ) -> tuple[list[str], ...]:
        """Answer without streaming: the same inputs and outputs as /ask, final values only.

        Requests arriving together are batched on the model. A bad request gets its error text in
        its own status output instead of failing the call.
        """
        rows: list[list[str]] = [[]] * len(image)
        admitted: list[tuple[int, ValidRequest]] = []
        reasoning = reasoning or [None] * len(image)  # left out by the client: the defaults
        beams = beams or [None] * len(image)
        for i, args in enumerate(
            zip(image, question, max_new_tokens, temperature, top_p, reasoning, beams, strict=True)
        ):
            try:
                admitted.append((i, dataclasses.replace(self.admit(*args), client=client_of(request))))
            except DemoError as err:
                self.metrics.rejected(err.code)
                rows[i] = list(render("", error_status(err), final=True))
            except Exception:  # never let one item fail the batch
                log.exception("unexpected error validating batch item %d", i)
                rows[i] = list(render("", error_status(GenerationError("Internal error reading this request.")), True))
        if admitted:
            try:
                results: list[Any] = list(self.backend.run_batch([valid for _, valid in admitted]))
            except Exception as exc:  # the backend promises not to raise; guard the promise anyway
                log.exception("run_batch raised")
                results = [GenerationError(f"Generation failed: {type(exc).__name__}")] * len(admitted)
            missing = [GenerationError("The backend returned no result for this item.")] * len(admitted)
            results = (results + missing)[: len(admitted)]
            for (i, valid), result in zip(admitted, results, strict=True):
                if isinstance(result, DemoError):
                    rows[i] = list(render("", error_status(self.for_visitor(result)), final=True))
                else:
                    beams = searched_beams(valid.params)
                    rows[i] = list(render(result.text, final=True, result=result, view=result.beam, beams=beams))
        return tuple(list(column) for column in zip(*rows, strict=True))
