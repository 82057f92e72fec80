"""The Gradio page: upload, question, four live chain-of-thought panels, and the two API endpoints.

This module builds components and wires events to :mod:`vlm_demo.handlers` (which validate at the
door and talk to a :class:`~vlm_demo.backends.base.Backend`); it holds no model logic.

- ``/ask`` streams the four stages into their panels (raw tags never reach a renderer). Gradio
  cannot batch generators, so batching happens in *our* engine: the handler's ``concurrency_limit``
  lets several visitors' requests reach the engine at once.
- ``/ask_batch`` is Gradio's own batch mode (``batch=True``) for API clients that want final answers.

Both take ``(image, question, max_new_tokens, temperature, top_p)`` and return plain strings
``(summary, caption, reasoning, conclusion, raw, status, extra, stages_html)``: ``extra`` is text
the model wrote outside the four tags, ``stages_html`` the stage strip that marks the active stage.
"""

from __future__ import annotations

import logging
import os

import gradio as gr

from vlm_demo.backends.base import Backend
from vlm_demo.config import Config
from vlm_demo.cot import STAGES, parse_stages
from vlm_demo.handlers import Handlers, tracker_html
from vlm_demo.metrics import Metrics

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


class DemoUI:
    """The page and its handlers, bound to one backend."""

    def __init__(self, backend: Backend, config: Config, metrics: Metrics, notice: str | None = None) -> None:
        self.backend = backend
        self.config = config
        self.notice = notice
        self.handlers = Handlers(backend, config, metrics)

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
            ask.click(self.handlers.ask, api_name="ask", **streaming)
            question.submit(self.handlers.ask, api_visibility="private", **streaming)
            # Not Gradio's ``cancels=``: it kills the handler before its last update, and an update
            # already in flight could then overwrite the "Stopped" status. Cancelling our stream
            # instead ends the handler normally, and it writes the final state itself.
            stop.click(self.handlers.stop, queue=False, api_visibility="undocumented")
            ask_batch = gr.Button(visible=False)  # /ask_batch is for API clients; the page streams
            ask_batch.click(
                self.handlers.ask_batch,
                inputs=inputs,
                outputs=outputs,
                api_name="ask_batch",
                batch=True,
                max_batch_size=self.config.max_batch_size,
                preprocess=False,
                concurrency_id=CONCURRENCY_ID,
                concurrency_limit=limit,
            )
            demo.unload(self.handlers.forget_session)
        demo.queue(max_size=self.config.max_queue, default_concurrency_limit=limit)
        return demo
