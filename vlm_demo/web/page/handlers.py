"""What the page's events do: the door, the streaming ``/ask``, ``/ask_batch``, Stop; no layout, no model,
no rendering (that is :mod:`~vlm_demo.web.page.render`'s).

- ``/ask`` streams. It is an *async* generator over the answer service's loop
  (:meth:`~vlm_demo.web.answers.Answers.follow`, paced for the page: the update interval grows with the
  number of live page answers so the web process spends a bounded share of a core on page updates however
  many visitors stream): no thread per visitor, the end of an answer wakes it at once, and each update
  parses the answer once. Outputs are plain strings
  sent without Gradio's postprocessing (the events set ``postprocess=False``): Gradio sends each
  output as a diff against the previous update, so an unchanged output costs nothing on the wire.
  ``gr.skip()`` is avoided on purpose: Gradio 6.31 rebuilds the whole component for every skipped
  output of every update, which measured as twice the web process's CPU per answer.
- ``/ask_batch`` is Gradio's batch mode (``batch=True``). Every item of a Gradio batch is submitted
  to the backend at once and the handler only waits for the results, so items join the engine's
  running batch as soon as Gradio hands them over, and several Gradio batches can be in flight.
  A bad item gets its error text in its own outputs (raising would fail every user in the batch).

Both take :data:`~vlm_demo.web.page.contract.INPUTS` (the last two optional: ``"normal"`` and 2) and return
:class:`~vlm_demo.web.page.contract.Outputs`, plain strings. With
``reasoning="stage-beam"`` (the page's "Think harder") the running stage's panel shows its candidates
as they are written and judged, then the winner; ``beams_html`` lists every stage's candidates with the
winner marked and the judge's words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import gradio as gr

from vlm_demo.errors import DemoError, GenerationError, InvalidRequestError, RequestCancelledError
from vlm_demo.images import load_image
from vlm_demo.request import DEFAULT_BEAMS, NORMAL, PAGE_KNOBS, ValidRequest, has_image, sampling_from, validate_request
from vlm_demo.results import GenerationResult
from vlm_demo.web.answers import PAGE, Answers, client_id
from vlm_demo.web.page.contract import Outputs
from vlm_demo.web.page.conversation import Conversation
from vlm_demo.web.page.render import error_status, for_visitor, progress, render, searched_beams

log = logging.getLogger(__name__)


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


def client_of(request: gr.Request | None) -> str:
    """Who asks from the page (:func:`~vlm_demo.web.answers.client_id`): the visitor's address, or on a
    loopback address the browser session."""
    if request is None:
        return ""
    return client_id(request.client.host if request.client is not None else "", request.session_hash)


# The page's inputs that have an error line beside them (page.py), and how the status line points to it.
FIELDS: dict[str, str] = {"image": "the image", "question": "the question"}


def input_field(error: DemoError) -> str | None:
    """Which of :data:`FIELDS` the door's refusal of a visitor's input is about: the picture (the door names no
    parameter for it) or the question; ``None`` for the rest (a server setting, a sampling value the page's
    controls cannot send), which the status line says."""
    if not isinstance(error, InvalidRequestError) or error.code != InvalidRequestError.code:
        return None
    field = error.param or "image"
    return field if field in FIELDS else None


class PageError(gr.Error):
    """A :class:`~vlm_demo.errors.DemoError` as Gradio shows it, still saying whether Retry can help and, for the
    door's refusal of an input, which page input to fix (``field``, one of :data:`FIELDS`)."""

    def __init__(self, error: DemoError, field: str | None = None) -> None:
        expected = error.code != GenerationError.code  # the rest are logged where they happen, or are the visitor's
        super().__init__(str(error), title=error.title, print_exception=not expected)
        self.retry_helps = error.retry_helps
        self.field = field


class Handlers:
    """The page's event handlers: a thin adapter over the answer service."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.limits = answers.limits

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
        """The shared door (:mod:`vlm_demo.request`) with the page's loose inputs."""
        values = dict(zip(PAGE_KNOBS, (max_new_tokens, temperature, top_p, reasoning, beams), strict=True))
        return validate_request(image, question, sampling_from(values, self.limits), self.limits, history)

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
    ) -> AsyncGenerator[Outputs, None]:
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
        """The page's Ask: like ``ask``, but a failure is shown once, over cleared panels (what was already
        streamed stays), instead of an error toast and a red mark on every output: in the status line, or for an
        input the door refused, on the error line beside that input (the image, the question box; the status
        line points there).

        A follow-up: the ``conversation``'s earlier turns go with the question, and every update also
        carries the two error lines, the question box and the conversation as it stands (a finished answer
        becomes its newest turn)."""
        talk = Conversation.of(conversation)
        seen = Seen()
        asked = talk.unfinished(question if isinstance(question, str) else "")
        inputs = (image, question, max_new_tokens, temperature, top_p, reasoning, beams, talk.history())
        sent = None  # the conversation the page holds: sent again only when it changes (a State output set
        # on every update would cost Gradio a component config rebuild each time; gr.skip() costs nothing)
        # The question box: emptied with the first update, once the request is taken (an input error leaves it
        # to be mended), so the visitor can type the next question while this one streams; nothing later
        # writes it (DemoUI.after_answer puts back a question that got no answer, into an empty box only).
        box = gr.update(value="")
        # The error lines beside the image and the question: plain values, emptied as the request is taken (an
        # unchanged value costs nothing on the wire; an update dict would rebuild the component every time).
        lines = dict.fromkeys(FIELDS, "")
        try:  # aclosing: when Gradio closes this generator (Clear, a closed tab) the inner one ends too
            async with contextlib.aclosing(self._ask(inputs, request, seen)) as updates:
                async for update in updates:
                    if seen.result is not None and seen.result.finish_reason in ("stop", "length"):
                        asked = talk.finished(asked.asked.strip(), seen.result.text)
                    yield (*update, *lines.values(), box, gr.skip() if asked is sent else asked)
                    sent, box = asked, gr.skip()
        except gr.Error as err:
            if isinstance(err, PageError) and not err.retry_helps:  # the input must change first: no Retry
                asked = talk.unfinished("")
            status = f"⚠ {err.title}: {err.message}"
            field = err.field if isinstance(err, PageError) else None
            if field:
                lines[field] = f"⚠ {err.message}"
                status = f"⚠ {err.title}: see the message by {FIELDS[field]}"
            final = render(seen.raw, status, final=True, ended="error")
            yield (*final, *lines.values(), gr.skip(), asked)

    async def _ask(
        self, inputs: tuple[Any, ...], request: gr.Request | None, seen: Seen | None = None
    ) -> AsyncGenerator[Outputs, None]:
        admitted: list[ValidRequest] = []

        def admit() -> ValidRequest:  # on a worker thread: decoding an upload takes up to ~0.1 s
            admitted.append(self.admit(*inputs))
            return admitted[-1]

        try:
            stream = await self.answers.start(admit, client_of(request))
        except DemoError as err:  # nothing admitted: the door refused the inputs themselves
            raise PageError(self.for_visitor(err), None if admitted else input_field(err)) from None
        beams = searched_beams(admitted[-1].params)  # candidates per stage, for the status line
        session = (request.session_hash if request is not None else None) or f"anonymous-{id(stream)}"
        started = time.monotonic()
        changes = Changes()
        raw = ""
        view = None
        second = -1  # the counter's whole seconds last shown
        try:  # aclosing: a closed tab ends the loop at once, and with it the answer (its model row is freed)
            async with contextlib.aclosing(self.answers.follow(stream, PAGE, session)) as moments:
                async for moment in moments:
                    view = moment.view
                    if moment.text:
                        raw += moment.text
                        if seen is not None:
                            seen.raw = raw
                    # New text, a queue position that may have moved, a search, or the counter's next second.
                    if moment.text or not raw or view is not None or int(moment.elapsed) != second:
                        second = int(moment.elapsed)
                        ahead = None if raw else stream.ahead()
                        update = changes(progress(raw, view, ahead, moment.elapsed, stream.tokens()))
                        if update is not None:
                            yield update
            result = stream.result(0)
        except RequestCancelledError:
            stopped = f"Stopped after {time.monotonic() - started:.1f} s."
            yield render(raw, stopped, final=True, view=view, ended="cancelled")
            return
        except DemoError as err:  # failed mid-answer: what was streamed stays in the panels
            raise PageError(self.for_visitor(err)) from None
        if seen is not None:
            seen.result = result
        yield render(result.text, final=True, result=result, view=result.beam or stream.beam_view(), beams=beams)

    def for_visitor(self, error: DemoError) -> DemoError:
        """The error in a visitor's words (a remote model server's transport details go to the log instead)."""
        backend = self.answers.backend
        shown = for_visitor(error, backend.remote)
        if shown is not error:
            log.warning("%s: %s (the visitor reads: %s)", backend.name, error, shown)
        return shown

    def stop(self, request: gr.Request = None) -> None:  # type: ignore[assignment]
        """Cancel this visitor's running answers only; other visitors' requests keep going."""
        session = request.session_hash if request is not None else None
        count = self.answers.cancel(session) if session else 0
        log.info("stop from session %s cancelled %d run(s)", session, count)

    def forget_session(self, request: gr.Request = None) -> None:  # type: ignore[assignment]
        """The tab was closed: free the model rows its runs were using."""
        if request is not None and request.session_hash:
            self.answers.cancel(request.session_hash)

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
                admitted.append((i, self.admit(*args)))
            except DemoError as err:
                self.answers.metrics.rejected(err.code)
                rows[i] = list(render("", error_status(err), final=True))
            except Exception:  # never let one item fail the batch
                log.exception("unexpected error validating batch item %d", i)
                rows[i] = list(render("", error_status(GenerationError("Internal error reading this request.")), True))
        if admitted:
            results = self.answers.run_batch([valid for _, valid in admitted], client_of(request))
            for (i, valid), result in zip(admitted, results, strict=True):
                if isinstance(result, DemoError):
                    rows[i] = list(render("", error_status(self.for_visitor(result)), final=True))
                else:
                    searched = searched_beams(valid.params)
                    rows[i] = list(render(result.text, final=True, result=result, view=result.beam, beams=searched))
        return tuple(list(column) for column in zip(*rows, strict=True))
