"""The Gradio page: upload, question, four live chain-of-thought panels, and the two API endpoints.

This module builds components and wires events to :mod:`vlm_demo.handlers` (which validate at the
door and talk to a :class:`~vlm_demo.backends.base.Backend`); it holds no model logic.

- ``/ask`` streams the four stages into their panels (raw tags never reach a renderer). Gradio
  cannot batch generators, so batching happens in *our* engine: the handler's ``concurrency_limit``
  lets several visitors' requests reach the engine at once.
- ``/ask_batch`` is Gradio's own batch mode (``batch=True``) for API clients that want final answers.

Both take ``(image, question, max_new_tokens, temperature, top_p, reasoning, beams)`` — the last two
optional, ``"normal"`` or ``"stage-beam"`` (the page's "Think harder") and 2–8 candidates per stage —
and return plain strings ``(summary, caption, reasoning, conclusion, raw, status, extra, stages_html,
beams_html)``: ``extra`` is text the model wrote outside the four tags, ``stages_html`` the stage strip
that marks the active stage, ``beams_html`` a stage-beam search's candidates and winners.
Every output component is labelled with that name, so the "Use via API" page and clients say it too.

The page's own Ask (button and Enter) runs ``handlers.ask_page``, not ``/ask``: the same stream, but a
request error is shown once, in the status line, instead of a toast plus an error mark on every output.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import gradio as gr

from vlm_demo.backends.base import Backend
from vlm_demo.config import Config
from vlm_demo.cot import STAGES, parse_stages
from vlm_demo.handlers import Handlers, tracker_html
from vlm_demo.metrics import Metrics
from vlm_demo.schema import (
    DEFAULT_BEAMS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    MAX_BEAMS,
    MAX_TEMPERATURE,
    NORMAL,
    STAGE_BEAM,
)

log = logging.getLogger(__name__)

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
CONCURRENCY_ID = "engine"  # /ask and /ask_batch share one limit: they share one model
PANEL_LINES = {"summary": 2, "caption": 3, "reasoning": 6, "conclusion": 2}
MIN_TOP_P = 0.05  # the server rejects top_p 0 when sampling, so the slider never offers it

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
PHOTOS_WITH_TINY = "Real photos: for the real model (the tiny test model only names a colour)"

# On a phone the columns stack and the panels sit below the inputs: after Ask, bring the stage strip (and
# the status line under it) to the top of the screen so the visitor sees the answer start. Side by side
# (desktop) the page only scrolls when the strip is out of view.
SHOW_ANSWER_JS = """() => {
    const strip = document.getElementById('stages');
    const ask = document.getElementById('ask');
    if (!strip || !ask) return;
    const top = strip.getBoundingClientRect().top;
    const stacked = top >= ask.getBoundingClientRect().bottom;
    if (stacked ? Math.abs(top) > 8 : top < 0 || top > window.innerHeight * 0.5) {
        strip.scrollIntoView({behavior: 'smooth', block: 'start'});
    }
}"""

THEME = gr.themes.Soft(primary_hue="indigo")
# Colours are set for light and dark mode (Gradio puts ``dark`` on <body>): the banner and the stage marks
# use their own colours, so each pair is chosen for contrast in both modes (tests measure the banner's).
# One selector per rule: Gradio scopes custom CSS by prefixing selectors, and it garbles the second
# selector of a ``.dark a, .dark b`` list.
CSS = (
    """
#banner { background: #fff4e5; border-left: 5px solid #d97706; border-radius: 6px; padding: 4px 14px; }
#banner * { color: #3b2506; }
#banner code { background: rgba(120, 53, 15, 0.12); }
.dark #banner { background: #2e2206; border-left-color: #f59e0b; }
.dark #banner * { color: #fde68a; }
.dark #banner code { background: rgba(253, 230, 138, 0.15); }
#banner p { margin: 6px 0; }
#upload_error { border-left: 4px solid var(--error-border-color); background: var(--error-background-fill); padding: 2px 10px; }
#upload_error * { color: var(--error-text-color); }
.cot-tracker { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; font-weight: 600; font-size: 0.9em; }
.cot-tracker .step { padding: 3px 10px; border-radius: 999px; background: var(--block-background-fill); border: 1px solid var(--border-color-primary); opacity: 0.6; }
.cot-tracker .step.done { opacity: 1; color: #166534; border-color: #22c55e; }
.dark .cot-tracker .step.done { color: #86efac; border-color: #22c55e; }
.cot-tracker .step.active { opacity: 1; color: #ffffff; background: #4f46e5; border-color: #4f46e5; }
.extra pre { white-space: pre-wrap; margin: 4px 0; }
.stage { border-radius: 10px; }
.stage [data-testid="block-info"] { text-transform: uppercase; color: #3730a3; }
.dark .stage [data-testid="block-info"] { color: #ffffff; }
"""
    # The marks go inside the panel's label chip, so they take the chip's own text colour (readable on
    # the chip in both modes) instead of an accent colour that vanishes on the accent-coloured chip.
    + "\n".join(
        f"body:has([data-active={s}]) #p_{s} {{ box-shadow: inset 0 0 0 2px #6366f1; background: rgba(99, 102, 241, 0.07); }}\n"
        f'body:has([data-active={s}]) #p_{s} [data-testid="block-info"]::after {{ content: "  ● writing…"; color: inherit; }}\n'
        f'body:has([data-done~={s}]) #p_{s} [data-testid="block-info"]::after {{ content: "  ✓"; color: inherit; }}'
        for s in STAGES
    )
    + """
#p_conclusion textarea { font-weight: 600; }
.beam-search { font-size: 0.9em; border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 6px 12px; }
.beam-search .beam-head { font-weight: 600; margin-bottom: 4px; }
.beam-search .beam-stage { margin: 6px 0; }
.beam-search ol { margin: 2px 0 2px 1.2em; padding: 0; }
.beam-search li.cand { opacity: 0.7; margin: 2px 0; }
.beam-search li.winner { opacity: 1; font-weight: 600; }
.beam-search .won { color: #166534; }
.dark .beam-search .won { color: #86efac; }
.beam-search pre { white-space: pre-wrap; margin: 2px 0; }
#status { min-height: 1.5em; font-size: 0.95em; }
"""
)


# The API's optional trailing inputs: a client written for the first five inputs keeps working.
OPTIONAL_INPUTS = {"ask": 2, "ask_batch": 2}


class Page(gr.Blocks):
    """``gr.Blocks`` that accepts calls leaving out an endpoint's optional trailing inputs.

    gradio_client fills them in from the API description, but a raw HTTP or JavaScript client that
    sends the original five values would be refused by Gradio's own count check; here the missing
    ones arrive as ``None`` and the handlers read that as the defaults.
    """

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        missing = len(block_fn.inputs) - len(inputs)
        if 0 < missing <= OPTIONAL_INPUTS.get(block_fn.api_name or "", 0):
            inputs.extend([None] * missing)
        super().validate_inputs(block_fn, inputs)


class DemoUI:
    """The page and its handlers, bound to one backend."""

    def __init__(self, backend: Backend, config: Config, metrics: Metrics, notice: str | None = None) -> None:
        self.backend = backend
        self.config = config
        self.notice = notice
        self.handlers = Handlers(backend, config, metrics)

    def upload_checked(self, image: Any) -> tuple[Any, ...]:
        """A new image (or none): its problem next to it at once, and the previous answer cleared."""
        message = self.handlers.check_upload(image)
        return (gr.update(value=f"⚠ {message}" if message else "", visible=bool(message)), *self.handlers.cleared())

    def cleared_page(self, request: gr.Request = None) -> tuple[Any, ...]:  # type: ignore[assignment]
        """The Clear button: this visitor's answer stopped (its model row freed at once), then no image,
        no question, no message, empty panels."""
        self.handlers.stop(request)
        return (None, "", gr.update(value="", visible=False), *self.handlers.cleared())

    # ---- the page -----------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        with Page(title="LLaVA-CoT demo") as demo:
            gr.Markdown(
                "# LLaVA-CoT · Llama-3.2V-11B-cot\n"
                "Upload an image and ask about it. The model thinks in four stages, shown live as it writes: "
                "**SUMMARY** (its plan) → **CAPTION** (what it sees) → **REASONING** → **CONCLUSION** (the answer).  \n"
                f"Model: `{self.backend.model}` · backend: `{self.backend.name}`",
                elem_id="header",
            )
            gr.Markdown(self.notice or "", elem_id="banner", visible=bool(self.notice))
            # Inputs, then the answer: on a phone the columns stack in this order, so the panels come right
            # after the Ask button and the examples come last (below the row).
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=320):
                    image, upload_error, question, ask, stop, clear, sliders, thinking = self._inputs()
                with gr.Column(scale=3, min_width=360):
                    tracker = gr.HTML(tracker_html(parse_stages(""), None), label="stages_html", elem_id="stages")
                    status = gr.Markdown("", label="status", elem_id="status")
                    panels = [
                        gr.Textbox(
                            label=stage,  # the API's output name; CSS shows it in capitals as the heading
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
                    extra = gr.Textbox(label="extra", visible=False, elem_id="p_extra")  # the strip shows it
                    beams_view = gr.HTML("", label="beams_html", elem_id="beams_view")
                    with gr.Accordion("Raw model output", open=False, elem_id="raw_box"):
                        raw = gr.Textbox(
                            label="raw", show_label=False, elem_id="raw", lines=8, interactive=False, buttons=["copy"]
                        )
            self._examples(image, question)

            inputs = [image, question, *sliders, *thinking]
            outputs = [*panels, raw, status, extra, tracker, beams_view]
            self._wire(demo, inputs, outputs, image, upload_error, question, ask, stop, clear)
        limit = self._concurrency_limit()
        demo.queue(max_size=self.config.max_queue, default_concurrency_limit=limit)
        return demo

    def _inputs(self) -> tuple[Any, ...]:
        image = gr.Image(type="filepath", label="Image", elem_id="img", sources=["upload", "clipboard"], height=300)
        upload_error = gr.Markdown("", elem_id="upload_error", visible=False)
        question = gr.Textbox(
            label="Question",
            info="Enter asks · Shift+Enter starts a new line",
            elem_id="q",
            lines=1,  # one line: Enter submits (Gradio's multi-line boxes submit only on Shift+Enter)
            max_lines=6,
            max_length=self.config.max_question_chars,
            placeholder="Ask something about the image…",
        )
        with gr.Row(equal_height=True, elem_id="think"):
            thinking = (
                gr.Radio(
                    [("Normal", NORMAL), ("Think harder", STAGE_BEAM)],
                    value=NORMAL,
                    label="Reasoning",
                    info="Think harder: for each stage the model writes several candidates and judges which is "
                    "best (LLaVA-CoT's stage-level beam search). Slower.",
                    elem_id="reasoning",
                    scale=3,
                ),
                gr.Slider(
                    2,
                    MAX_BEAMS,
                    DEFAULT_BEAMS,
                    step=1,
                    precision=0,
                    label="Candidates per stage",
                    elem_id="beams",
                    scale=2,
                ),
            )
        with gr.Row():
            ask = gr.Button("Ask", variant="primary", elem_id="ask", scale=2)
            stop = gr.Button("Stop", variant="stop", elem_id="stop", min_width=80)
            clear = gr.Button("Clear", variant="secondary", elem_id="clear", min_width=80)
        cap = self.config.max_new_tokens
        with gr.Accordion("Advanced", open=False, elem_id="advanced"):
            sliders = (
                gr.Slider(  # precision=0: the API page types max_new_tokens as an integer
                    1,
                    cap,
                    min(DEFAULT_MAX_NEW_TOKENS, cap),
                    step=1,
                    precision=0,
                    label="Max new tokens",
                    elem_id="max_new_tokens",
                ),
                gr.Slider(
                    0.0,
                    MAX_TEMPERATURE,
                    DEFAULT_TEMPERATURE,
                    step=0.05,
                    label="Temperature (0 = greedy)",
                    elem_id="temperature",
                ),
                gr.Slider(MIN_TOP_P, 1.0, DEFAULT_TOP_P, step=0.05, label="Top-p", elem_id="top_p"),
            )
        return image, upload_error, question, ask, stop, clear, sliders, thinking

    def _examples(self, image: gr.Image, question: gr.Textbox) -> None:
        with gr.Row(equal_height=False):
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
                label=PHOTOS_WITH_TINY if self.notice else "Examples",
                elem_id="examples",
            )

    def _concurrency_limit(self) -> int:
        return max(2 * self.config.max_batch_size, 4)  # enough running handlers to fill a batch and queue the next

    def _wire(
        self,
        demo: gr.Blocks,
        inputs: list[Any],
        outputs: list[Any],
        image: gr.Image,
        upload_error: gr.Markdown,
        question: gr.Textbox,
        ask: gr.Button,
        stop: gr.Button,
        clear: gr.Button,
    ) -> None:
        streaming: dict[str, Any] = dict(
            inputs=inputs,
            outputs=outputs,
            preprocess=False,  # our own caps and messages for the image, not PIL's (see images.py)
            postprocess=False,  # plain strings; Gradio's per-output postprocessing doubled the web CPU per answer
            concurrency_id=CONCURRENCY_ID,
            concurrency_limit=self._concurrency_limit(),
            show_progress="minimal",
        )
        # The public /ask (raises gr.Error for API clients) sits on a hidden button; the page's Ask and
        # Enter run ask_page, which shows an error once, in the status line.
        gr.Button(visible=False, elem_id="ask_api").click(self.handlers.ask, api_name="ask", **streaming)
        running = [
            trigger(self.handlers.ask_page, api_visibility="private", **streaming)
            for trigger in (ask.click, question.submit)
        ]
        for trigger in (ask.click, question.submit):
            trigger(None, js=SHOW_ANSWER_JS)
        # Not Gradio's ``cancels=``: it kills the handler before its last update, and an update
        # already in flight could then overwrite the "Stopped" status. Cancelling our stream
        # instead ends the handler normally, and it writes the final state itself.
        stop.click(self.handlers.stop, queue=False, api_visibility="undocumented")
        # Clear stops this visitor's answer like Stop does, and also drops the handler (``cancels=``):
        # its last update must not bring the old answer back.
        clear.click(
            self.cleared_page,
            outputs=[image, question, upload_error, *outputs],
            cancels=running,
            queue=False,
            show_progress="hidden",
            api_visibility="private",
        )
        image.change(
            self.upload_checked,
            inputs=[image],
            outputs=[upload_error, *outputs],
            preprocess=False,
            queue=False,
            show_progress="hidden",  # a quick check: no spinner over every output
            api_visibility="private",
        )
        gr.Button(visible=False).click(
            self.handlers.ask_batch,
            inputs=inputs,
            outputs=outputs,
            api_name="ask_batch",
            batch=True,
            max_batch_size=self.config.max_batch_size,
            preprocess=False,
            concurrency_id=CONCURRENCY_ID,
            concurrency_limit=self._concurrency_limit(),
        )
        demo.unload(self.handlers.forget_session)
