"""The Gradio page: upload, question, four live chain-of-thought panels, and the two API endpoints.

This module builds components and wires events; it validates input at the door and talks to a
:class:`~vlm_demo.backends.base.Backend`, and holds no model logic.

- ``/ask`` streams: a generator that submits one request to the backend and turns the text as it
  grows into four panel values (via :func:`vlm_demo.cot.parse_stages`, so raw tags never reach a
  renderer). Gradio cannot batch generators, so batching happens in *our* engine: the handler's
  ``concurrency_limit`` lets several visitors' requests reach the engine at once.
- ``/ask_batch`` is Gradio's own batch mode (``batch=True``): the whole Gradio batch goes to
  ``backend.run_batch`` in one call, and a bad item gets its error text in its own outputs, because
  raising would fail every user in the batch and returning fewer items would hang some of them.

Both take ``(image, question, max_new_tokens, temperature, top_p)`` and return plain strings
``(summary, caption, reasoning, conclusion, raw, status, extra, stages_html)``: ``extra`` is text
the model wrote outside the four tags, ``stages_html`` the stage strip that marks the active stage.
"""

from __future__ import annotations

import html
import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from vlm_demo.backends.base import Backend, Stream
from vlm_demo.config import Config
from vlm_demo.cot import STAGES, Stages, parse_stages
from vlm_demo.engine.request import GenerationResult, SamplingParams, validate_question
from vlm_demo.errors import DemoError, GenerationError, InvalidRequestError, RequestCancelledError
from vlm_demo.images import load_image
from vlm_demo.metrics import Metrics
from vlm_demo.spaces_compat import gpu

log = logging.getLogger(__name__)

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
CONCURRENCY_ID = "engine"  # /ask and /ask_batch share one limit: they share one model
UPDATE_INTERVAL_S = 0.05  # at most ~20 page updates a second per answer, however fast tokens come
TOKEN_TIMEOUT_S = 300.0  # longest silence tolerated from the backend before giving up on a request
DEFAULT_MAX_NEW_TOKENS = 1024  # LLaVA-CoT answers run ~300-1000 tokens
PANEL_LINES = {"summary": 2, "caption": 3, "reasoning": 6, "conclusion": 2}

EXAMPLES = [
    ("astronaut.jpg", "What is the person holding, and what does the background tell you about her job?"),
    ("chelsea.jpg", "What animal is this, and what is it doing?"),
    ("coffee.jpg", "What drink is in the cup, and what is the cup standing on?"),
    ("coins.jpg", "How many coins are in the image?"),
    ("rocket.jpg", "What is happening in this photo, and what time of day is it?"),
]
TINY_EXAMPLES = [
    ("tiny/red.png", "What colour is this image?"),
    ("tiny/blue.png", "Describe this picture in detail."),  # "detail" makes the tiny model answer at length
    ("tiny/yellow.png", "What do you see?"),
]

ERROR_TITLES = {
    "invalid_request": "Invalid input",
    "server_busy": "Server busy",
    "out_of_memory": "Out of GPU memory",
    "cancelled": "Stopped",
    "backend_unavailable": "Backend unavailable",
    "backend_timeout": "Backend timeout",
}

THEME = gr.themes.Soft(primary_hue="indigo")
CSS = (
    """
#banner { background: #fff4e5; border-left: 5px solid #f59e0b; border-radius: 6px; padding: 4px 14px; }
#banner p { margin: 6px 0; }
.cot-tracker { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; font-weight: 600; font-size: 0.9em; }
.cot-tracker .step { padding: 3px 10px; border-radius: 999px; background: var(--block-background-fill); border: 1px solid var(--border-color-primary); opacity: 0.6; }
.cot-tracker .step.done { opacity: 1; color: #15803d; border-color: #86efac; }
.cot-tracker .step.active { opacity: 1; color: white; background: var(--color-accent); border-color: var(--color-accent); }
.extra pre { white-space: pre-wrap; margin: 4px 0; }
.stage { border-radius: 10px; transition: box-shadow .2s, background .2s; }
"""
    + "\n".join(
        f"body:has([data-active={s}]) #p_{s} {{ box-shadow: inset 0 0 0 2px #6366f1; background: rgba(99, 102, 241, 0.07); }}\n"
        f'body:has([data-active={s}]) #p_{s} [data-testid="block-info"]::after {{ content: "  ● writing…"; color: var(--color-accent); }}\n'
        f'body:has([data-done~={s}]) #p_{s} [data-testid="block-info"]::after {{ content: "  ✓"; color: #16a34a; }}'
        for s in STAGES
    )
    + """
#p_conclusion textarea { font-weight: 600; }
#status { min-height: 1.5em; font-size: 0.95em; opacity: 0.9; }
"""
)


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


class _Pump:
    """Drains a stream on its own thread so the reader can take everything that arrived at once."""

    def __init__(self, stream: Stream, timeout: float) -> None:
        self.cond = threading.Condition()
        self.pending: list[str] = []
        self.done = False
        self.error: BaseException | None = None
        self._stream, self._timeout = stream, timeout
        threading.Thread(target=self._run, name="vlm-ui-stream", daemon=True).start()

    def _run(self) -> None:
        try:
            for delta in self._stream.stream(timeout=self._timeout):
                with self.cond:
                    self.pending.append(delta)
                    self.cond.notify()
        except BaseException as err:  # handed to the reader, which re-raises it
            self.error = err
        finally:
            with self.cond:
                self.done = True
                self.cond.notify()


def coalesced(stream: Stream, timeout: float, interval: float = UPDATE_INTERVAL_S) -> Iterator[str]:
    """The stream's text in chunks at most every ``interval`` seconds; re-raises the stream's error.

    Yielding per token would send one page update per token to every visitor (hundreds a second
    with batching), which starves Gradio's event loop; humans cannot see faster than ~20 updates/s.
    """
    pump = _Pump(stream, timeout)
    while True:
        with pump.cond:
            pump.cond.wait_for(lambda: pump.pending or pump.done)
            text, done = "".join(pump.pending), pump.done
            pump.pending.clear()
        if text:
            yield text
        if done:
            break
        time.sleep(interval)
    if pump.error is not None:
        raise pump.error


@dataclass(frozen=True)
class Admitted:
    """A request that passed the door: a decoded RGB image, a clean question, checked parameters."""

    image: Any
    question: str
    params: SamplingParams


def _number(name: str, value: Any) -> float:
    """Accept numbers (or numeric strings from loose API clients); reject bool, None, NaN, inf."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise InvalidRequestError(f"{name} must be a number, not {value[:20]!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number.")
    return value


def tracker_html(stages: Stages, active: str | None) -> str:
    """The stage strip above the panels; page CSS keys on ``data-active``/``data-done`` to mark the panels.

    Marking panels through this one HTML output keeps the panels' API values plain strings (a
    ``gr.update`` with CSS classes would reach API clients as a dict).
    """
    done = [s for s in stages.seen if s != active]
    steps = []
    for stage in STAGES:
        state = "active" if stage == active else "done" if stage in done else "todo"
        mark = {"active": " ●", "done": " ✓", "todo": ""}[state]
        steps.append(f'<span class="step {state}">{stage.upper()}{mark}</span>')
    body = ' <span class="arrow">→</span> '.join(steps)
    extra = ""
    if stages.extra:
        extra = (
            '<div class="extra"><b>Text outside the four stages:</b><pre>' + html.escape(stages.extra) + "</pre></div>"
        )
    return f'<div class="cot-tracker" data-active="{active or ""}" data-done="{" ".join(done)}">{body}</div>{extra}'


def _result_status(result: GenerationResult) -> str:
    """The status line for a finished answer: how it ran (batch size) and how fast."""
    parts = [
        "Done" if result.finish_reason != "length" else "Stopped at the max new tokens limit",
        f"batch of {result.batch_size}",
        f"{result.completion_tokens} tokens",
        f"{result.tokens_per_s:.1f} tokens/s",
        f"{result.total_s:.2f} s",
    ]
    if result.queue_s >= 0.05:
        parts.append(f"waited {result.queue_s:.2f} s")
    return " · ".join(parts)


def _error_status(error: DemoError) -> str:
    return f"Error ({error.code}): {error}"


def render(raw: str, status: str, final: bool = False) -> tuple[str, ...]:
    """All outputs for one moment of an answer, as plain strings (what API clients receive too).

    Order: summary, caption, reasoning, conclusion, raw, status, text outside the stages, stage strip.
    """
    stages = parse_stages(raw, final=final)
    active = None if final else stages.active
    if final and raw.strip() and not stages.seen:
        status += " · the answer did not use the four stages (shown above the panels)"
    return (*stages.as_tuple(), raw, status, stages.extra, tracker_html(stages, active))


class DemoUI:
    """The page and its handlers, bound to one backend."""

    def __init__(self, backend: Backend, config: Config, metrics: Metrics, notice: str | None = None) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.notice = notice
        self.sessions = Sessions()

    # ---- the door -------------------------------------------------------------------------------
    def admit(self, image: Any, question: Any, max_new_tokens: Any, temperature: Any, top_p: Any) -> Admitted:
        """Validate everything before the backend sees it; cheap checks first, image decoding last."""
        if image is None or image == "" or (isinstance(image, dict) and not (image.get("path") or image.get("url"))):
            raise InvalidRequestError("Please upload an image first.")
        question = validate_question(question, self.config.max_question_chars)
        if "\x00" in question:
            raise InvalidRequestError("The question contains a NUL character; please send plain text.")
        params = SamplingParams(
            max_new_tokens=_number("max_new_tokens", max_new_tokens),
            temperature=_number("temperature", temperature),
            top_p=_number("top_p", top_p),
        ).validated(self.config.max_new_tokens)
        picture = load_image(image, max_pixels=self.config.max_image_pixels)
        return Admitted(picture, question, params)

    def _refuse(self, error: DemoError) -> gr.Error:
        self.metrics.rejected(error.code)
        return _gr_error(error)

    # ---- /ask: one streaming request --------------------------------------------------------------
    def ask(
        self,
        image: Any,
        question: Any,
        max_new_tokens: Any,
        temperature: Any,
        top_p: Any,
        request: gr.Request = None,  # type: ignore[assignment]  # Gradio injects it
    ) -> Iterator[tuple[Any, ...]]:
        """Stream the four stages of one answer into the panels as tokens arrive."""
        try:
            admitted = self.admit(image, question, max_new_tokens, temperature, top_p)
            stream = self.backend.submit(admitted.image, admitted.question, admitted.params)
        except DemoError as err:
            raise self._refuse(err) from None
        session = getattr(request, "session_hash", None) or f"anonymous-{id(stream)}"
        self.sessions.add(session, stream)
        started = time.monotonic()
        raw = ""
        try:
            yield render(raw, "Waiting for the model…")
            for delta in coalesced(stream, TOKEN_TIMEOUT_S):
                raw += delta
                writing = parse_stages(raw).active
                where = f"writing {writing.upper()}" if writing else "writing"
                yield render(raw, f"Generating · {where} · {time.monotonic() - started:.1f} s")
            result = stream.result(timeout=TOKEN_TIMEOUT_S)
        except RequestCancelledError:
            yield render(raw, f"Stopped after {time.monotonic() - started:.1f} s.", final=True)
            return
        except TimeoutError:
            stream.cancel()
            raise gr.Error(f"The model sent nothing for {TOKEN_TIMEOUT_S:.0f} s; please try again.") from None
        except DemoError as err:  # failed mid-answer: what was streamed stays in the panels
            raise _gr_error(err) from None
        finally:
            self.sessions.discard(session, stream)
            stream.cancel()  # no-op when finished; frees the model row if the visitor went away
        yield render(result.text, _result_status(result), final=True)

    def stop(self, request: gr.Request = None) -> None:  # type: ignore[assignment]
        """Cancel this visitor's running answers only; other visitors' requests keep going."""
        session = getattr(request, "session_hash", None)
        count = self.sessions.cancel(session) if session else 0
        log.info("stop from session %s cancelled %d run(s)", session, count)

    def forget_session(self, request: gr.Request = None) -> None:  # type: ignore[assignment]
        """The tab was closed: free the model rows its runs were using."""
        if request is not None and request.session_hash:
            self.sessions.cancel(request.session_hash)

    # ---- /ask_batch: Gradio batch mode ------------------------------------------------------------
    def ask_batch(
        self,
        images: list[Any],
        questions: list[Any],
        max_new_tokens: list[Any],
        temperatures: list[Any],
        top_ps: list[Any],
    ) -> tuple[list[str], ...]:
        """Answer a whole Gradio batch with one backend call; never raises, always one row per item."""
        rows: list[list[str]] = [[]] * len(images)
        admitted: list[tuple[int, Admitted]] = []
        for i, args in enumerate(zip(images, questions, max_new_tokens, temperatures, top_ps, strict=True)):
            try:
                admitted.append((i, self.admit(*args)))
            except DemoError as err:
                self.metrics.rejected(err.code)
                rows[i] = list(render("", _error_status(err), final=True))
            except Exception:  # never let one item fail the batch
                log.exception("unexpected error validating batch item %d", i)
                rows[i] = list(
                    render("", _error_status(GenerationError("Internal error reading this request.")), final=True)
                )
        if admitted:
            items = [(a.image, a.question, a.params) for _, a in admitted]
            try:
                results: list[Any] = list(self.backend.run_batch(items))
            except Exception as exc:  # the backend promises not to raise; guard the promise anyway
                log.exception("run_batch raised")
                results = [GenerationError(f"Generation failed: {type(exc).__name__}")] * len(items)
            missing = [GenerationError("The backend returned no result for this item.")] * len(items)
            results = (results + missing)[: len(items)]
            for (i, _), result in zip(admitted, results, strict=True):
                if isinstance(result, DemoError):
                    rows[i] = list(render("", _error_status(result), final=True))
                else:
                    rows[i] = list(render(result.text, _result_status(result), final=True))
        return tuple(list(column) for column in zip(*rows, strict=True))

    # ---- the page -----------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        cap = self.config.max_new_tokens
        with gr.Blocks(title="LLaVA-CoT demo") as demo:
            gr.Markdown(
                "# LLaVA-CoT · Llama-3.2V-11B-cot\n"
                "Upload an image and ask about it. The model thinks in four stages, shown live as it writes: "
                "**SUMMARY** (its plan) → **CAPTION** (what it sees) → **REASONING** → **CONCLUSION** (the answer).  \n"
                f"Model: `{self.backend.model}` · backend: `{self.backend.name}`",
                elem_id="header",
            )
            gr.Markdown(self.notice or "", elem_id="banner", visible=bool(self.notice))
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=320):
                    image = gr.Image(
                        type="filepath", label="Image", elem_id="img", sources=["upload", "clipboard"], height=300
                    )
                    question = gr.Textbox(
                        label="Question",
                        elem_id="q",
                        lines=2,
                        max_length=self.config.max_question_chars,
                        placeholder="Ask something about the image…",
                    )
                    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                        max_new_tokens = gr.Slider(
                            1, cap, value=min(DEFAULT_MAX_NEW_TOKENS, cap), step=1, label="Max new tokens",
                            elem_id="max_new_tokens",
                        )  # fmt: skip
                        temperature = gr.Slider(
                            0.0, 2.0, value=0.6, step=0.05, label="Temperature (0 = greedy)", elem_id="temperature"
                        )
                        top_p = gr.Slider(0.0, 1.0, value=0.9, step=0.05, label="Top-p", elem_id="top_p")
                    with gr.Row():
                        ask = gr.Button("Ask", variant="primary", elem_id="ask")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    if self.notice:
                        gr.Examples(
                            [[os.path.join(ASSETS_DIR, f), q] for f, q in TINY_EXAMPLES],
                            inputs=[image, question],
                            label="Examples for the tiny test model (solid colours)",
                            elem_id="examples_tiny",
                        )
                    gr.Examples(
                        [[os.path.join(ASSETS_DIR, f), q] for f, q in EXAMPLES],
                        inputs=[image, question],
                        label="Examples",
                        elem_id="examples",
                    )
                with gr.Column(scale=3, min_width=360):
                    tracker = gr.HTML(tracker_html(parse_stages(""), None), elem_id="stages")
                    panels = [
                        gr.Textbox(
                            label=stage.upper(),
                            elem_id=f"p_{stage}",
                            elem_classes=["stage"],
                            lines=PANEL_LINES[stage],
                            max_lines=40,
                            interactive=False,
                            autoscroll=True,
                            buttons=["copy"],
                        )
                        for stage in STAGES
                    ]
                    extra = gr.Textbox(visible=False, elem_id="p_extra")  # API output; the strip shows it
                    status = gr.Markdown("", elem_id="status")
                    with gr.Accordion("Raw model output", open=False, elem_id="raw_box"):
                        raw = gr.Textbox(show_label=False, elem_id="raw", lines=8, interactive=False, buttons=["copy"])

            inputs = [image, question, max_new_tokens, temperature, top_p]
            outputs = [*panels, raw, status, extra, tracker]
            limit = max(2 * self.config.max_batch_size, 4)  # enough running handlers to fill a batch and queue the next
            streaming = dict(  # the Ask button and Enter in the question box run the same handler
                inputs=inputs,
                outputs=outputs,
                preprocess=False,  # our own caps and messages for the image, not PIL's (see images.py)
                concurrency_id=CONCURRENCY_ID,
                concurrency_limit=limit,
                show_progress="minimal",
            )
            ask.click(gpu(self.ask), api_name="ask", **streaming)
            question.submit(gpu(self.ask), api_visibility="private", **streaming)
            # Not Gradio's ``cancels=``: it kills the handler before its last update, and an update
            # already in flight could then overwrite the "Stopped" status. Cancelling our stream
            # instead ends the handler normally, and it writes the final state itself.
            stop.click(self.stop, queue=False, api_visibility="undocumented")
            ask_batch = gr.Button(visible=False)  # /ask_batch is for API clients; the page streams
            ask_batch.click(
                gpu(self.ask_batch),
                inputs=inputs,
                outputs=outputs,
                api_name="ask_batch",
                batch=True,
                max_batch_size=self.config.max_batch_size,
                preprocess=False,
                concurrency_id=CONCURRENCY_ID,
                concurrency_limit=limit,
            )
            demo.unload(self.forget_session)
        demo.queue(max_size=self.config.max_queue, default_concurrency_limit=limit)
        return demo


def _gr_error(error: DemoError) -> gr.Error:
    quiet = error.code in ("invalid_request", "server_busy", "cancelled")
    return gr.Error(str(error), title=ERROR_TITLES.get(error.code, "Error"), print_exception=not quiet)
